package leader

import (
	"context"
	"errors"
	"time"
)

// Candidate identifies one Elector to a Store.
//
// ID is the human-readable name shown in status output and logs; several
// instances may share it by mistake. Token is a random value unique to one
// Elector (see [New]); a Store decides who holds a lease by comparing tokens,
// never IDs, so two instances started with the same ID can never both hold or
// renew one lease (DESIGN.md invariant 3).
//
// Priority is the candidate's Config.Priority. A store records it with
// each grant (Lease.Priority) and in Transferer.Enlist; stores that do not
// implement Transferer may ignore it.
type Candidate struct {
	ID       string
	Token    string
	Priority int
}

// Lease is what a Store reports about one name at the moment it answered.
//
// Times are read on the store's clock (for PostgreSQL, the database server's
// clock), never on the client's. AcquiredAt and ExpiresAt are for display;
// decisions use Remaining, which the store computes on its own clock so that
// clients whose wall clocks disagree with the store still agree on how long the
// lease has left.
type Lease struct {
	// Name is the election name.
	Name string
	// HolderID is the candidate ID of the holder, or "" when the lease is free
	// (never granted, released, or expired).
	HolderID string
	// Term is the fencing term of the current or last grant: it grows by one at
	// every new grant of the name and never goes back. 0 means never granted.
	Term uint64
	// AcquiredAt is when the current holder was granted the lease.
	AcquiredAt time.Time
	// ExpiresAt is when the lease runs out unless renewed.
	ExpiresAt time.Time
	// Remaining is ExpiresAt minus the store's "now" when it answered; zero
	// when the lease is free.
	Remaining time.Duration

	// The fields below are reported by stores that implement Transferer;
	// others leave them zero.

	// Priority is the holder's Candidate.Priority, as granted.
	Priority int
	// Reason says why the current (or last) holder was granted the lease:
	// see GrantReason.
	Reason GrantReason
	// Transfer is the pending request that the holder hand over (see
	// Transferer.RequestTransfer); its Remaining is zero when there is
	// none.
	Transfer TransferRequest
	// Successor is the candidate ID that a free lease is reserved for
	// after a handover (see Transferer.ReleaseTo), for Reserved more;
	// "" and zero when it is not reserved.
	Successor string
	Reserved  time.Duration
}

// Held reports whether the lease had a holder when the store answered.
func (l Lease) Held() bool { return l.HolderID != "" && l.Remaining > 0 }

// Store is the contract between the Elector and a backend. The Elector knows
// nothing about SQL or files; a Store knows nothing about callbacks. Every
// implementation must pass the conformance suite in package leadertest
// (leadertest.TestStore).
//
// All methods are safe for concurrent use, honour ctx (returning promptly with
// an error wrapping ctx.Err() when it ends), and judge expiry on the store's
// own clock. A Store may be shared by many Electors and many names.
type Store interface {
	// Acquire grants the lease for name to c for ttl if it is free, expired,
	// or already held by c.Token. Every grant, including one to the current
	// holder, is a new grant: the term grows by one. Acquire reports whether
	// the lease was granted and, either way, the lease as it stands after the
	// attempt (the current holder and its Remaining when not granted). A
	// refusal may report the lease as it stood when the attempt began, when
	// a release or a grant commits during it: the caller learns of that by
	// the release's wake-up (see Watch) or its next attempt. Losing the race
	// to another candidate is not an error.
	Acquire(ctx context.Context, name string, c Candidate, ttl time.Duration) (Lease, bool, error)

	// Renew extends the lease for name by ttl from the store's now, but only
	// if it is still held, unexpired, by token under term. Otherwise it
	// changes nothing and returns an error wrapping ErrLeaseLost. Renew never
	// creates a lease and never takes one from another holder.
	Renew(ctx context.Context, name, token string, term uint64, ttl time.Duration) (Lease, error)

	// Release frees the lease for name if it is held by token under term, and
	// wakes the name's watchers. The term is kept, so the next grant is
	// term+1. Releasing a lease that is not held by token under term changes
	// nothing and returns an error wrapping ErrLeaseLost.
	Release(ctx context.Context, name, token string, term uint64) error

	// Observe reports the lease for name without changing it. A name never
	// granted reports a zero Lease with Name set and a nil error.
	Observe(ctx context.Context, name string) (Lease, error)

	// Watch returns a channel that receives a value soon after the lease for
	// name is released or granted, so followers can try at once instead of
	// waiting for the expiry. Values are coalesced (a slow reader sees one
	// value for many events) and may be spurious. The channel is closed after
	// ctx ends. A store that cannot deliver wake-ups at the moment (for
	// example behind a transaction-pooling proxy) keeps the channel silent;
	// followers then rely on the expiry the store reported.
	Watch(ctx context.Context, name string) (<-chan struct{}, error)
}

// FreeWatcher is implemented by a Store that can wake a watcher only when
// a lease may have become free: released, or its holder gone, but not
// granted. The Elector's followers watch with WatchFree where the store
// offers it, and with Store.Watch elsewhere. A grant ends no follower's
// wait, and a follower that raced for the lease and lost has just learned
// of the grant from its own Acquire: waking every follower again on the
// grant would cost each one another attempt per handover.
type FreeWatcher interface {
	// WatchFree is Store.Watch without the wake-ups for grants: the
	// channel receives a value soon after the lease for name is released
	// (or, where the store can tell, its holder has gone). Values are
	// coalesced and may be spurious. The channel is closed after ctx ends.
	WatchFree(ctx context.Context, name string) (<-chan struct{}, error)
}

// BatchRenewer is implemented by a Store that can renew many leases with one
// request. The Electors of a process that lead on one such store with one
// RenewInterval renew together: their renewals fall on one grid of times
// (see Config.RenewInterval), and at each point of it one goroutine of the
// process calls RenewBatch once for all of their leases and extends each
// Elector's local deadline from the outcome, instead of each Elector calling
// Renew on a goroutine of its own. A store that holds thousands of names in
// one process then costs one request and one goroutine wake-up per round.
//
// The store value is the key of that sharing, so it must be comparable (a
// pointer, typically); Electors on a store that is not renew one by one.
type BatchRenewer interface {
	// RenewBatch does what Store.Renew does for each element of batch, as
	// if for each separately: one lease found lost fails with an error
	// wrapping ErrLeaseLost and the others are still renewed. It reports
	// each outcome in the element's Lease and Err, and sets every Err
	// (to an error wrapping ctx.Err() or ErrUnavailable, say) when it
	// cannot tell an outcome. It must honour ctx like every Store method,
	// and must not keep batch after it returns.
	RenewBatch(ctx context.Context, batch []Renewal)
}

// Renewal is one element of a RenewBatch call: the lease to renew, and the
// outcome that RenewBatch reports, as Store.Renew would have returned it.
type Renewal struct {
	Name  string
	Token string
	Term  uint64
	TTL   time.Duration

	// Lease is the renewed lease, set when Err is nil.
	Lease Lease
	// Err is the reason the lease was not renewed, nil if it was.
	Err error
}

// LossNotifier is implemented by a Store that can learn that a lease is lost
// before the holder's next renewal would find out: for example a store
// whose lease is a lock held by a server session, which learns the moment
// the server ends that session. The Elector checks for it at each grant and
// steps down as soon as the channel is closed, without waiting for the next
// renewal.
type LossNotifier interface {
	// Lost returns a channel that is closed once the store knows that the
	// lease for name granted to token under term is no longer held, or nil
	// if it cannot tell for that lease. The channel must not be closed
	// while the lease is held.
	Lost(name, token string, term uint64) <-chan struct{}
}

// LossWatchStopper is implemented by a LossNotifier whose watching for a
// loss stands in the way of the holder's next call: for example a store
// that reads the lease's own server session while it is idle, and must
// stop reading before it can send the release. The Elector calls
// StopLossWatch as soon as a tenure's leadership has ended (IsLeader is
// false and the leader context cancelled), before OnDemoted runs, when it
// will release the lease or hand it over afterwards, since it no longer
// waits on Lost for that tenure; the store can then stop watching while
// OnDemoted runs, rather than at the start of the release.
type LossWatchStopper interface {
	LossNotifier
	// StopLossWatch tells the store that nobody waits on Lost(name,
	// token, term) any more. It must return at once, doing any work in
	// the background, and change nothing of the lease: the channel may
	// then never be closed.
	StopLossWatch(name, token string, term uint64)
}

// Errors a Store returns, wrapped with detail; test them with errors.Is.
var (
	// ErrLeaseLost means the lease is not (or no longer) held by the caller's
	// token and term: it expired, was released, or was granted to another.
	ErrLeaseLost = errors.New("leader: lease not held")

	// ErrReadOnly means the store accepts reads but refuses writes (for
	// example a PostgreSQL hot standby, SQLSTATE 25006). A leader that sees it
	// steps down at once instead of retrying until its deadline.
	ErrReadOnly = errors.New("leader: store is read-only")

	// ErrUnavailable means the store could not be reached or the connection
	// broke during the call. The outcome of a write that fails this way is
	// unknown.
	ErrUnavailable = errors.New("leader: store unavailable")

	// ErrPermanent means the store refused the call for a reason that
	// retrying will not mend until a person changes something: the
	// credentials, the database name, the schema (tables never migrated),
	// the role's privileges, or a server that stays read-only. The error
	// wrapping it says what to do. Run returns such an error at once when
	// it comes before any store call of this Elector has succeeded (a
	// misconfigured deployment fails at start); after one has, the Elector
	// logs it at ERROR, shows it in Status.Problem, retries with backoff
	// (a DBA may mend grants while the service runs), and leads again once
	// the store answers. See "Errors" in the package documentation.
	ErrPermanent = errors.New("leader: store misconfigured")
)
