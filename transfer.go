package leader

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"
)

// GrantReason says why a lease was granted: how leadership last moved. A
// Store that implements Transferer records it with each grant and reports
// it in Lease.Reason.
type GrantReason string

// The reasons a lease is granted.
const (
	// GrantFirst: the first grant of the name, or a grant to the holder
	// itself; also what stores that do not record reasons report.
	GrantFirst GrantReason = ""
	// GrantRelease: the lease was free, released by its last holder.
	GrantRelease GrantReason = "release"
	// GrantExpiry: the last holder's lease ran out, or its holder was gone
	// (a crash, a lost connection, a pause past the TTL).
	GrantExpiry GrantReason = "expiry"
	// GrantTransfer: the last holder handed the lease to this candidate,
	// by Elector.Transfer or a request from RequestTransfer.
	GrantTransfer GrantReason = "transfer"
	// GrantPriority: the last holder handed the lease to this candidate
	// because its Config.Priority is higher.
	GrantPriority GrantReason = "priority"
)

// TransferRequest is a request that the holder of a lease hand it over,
// as a Store reports it in Lease.Transfer.
type TransferRequest struct {
	// To is the candidate ID to hand over to, or "" for the best
	// candidate: the one with the highest priority.
	To string `json:"to,omitempty"`
	// Reason is GrantTransfer, or GrantPriority for a request that a
	// candidate with a higher priority makes of a leader with a lower one.
	Reason GrantReason `json:"reason"`
	// Remaining is how long the request stays pending unless the holder
	// acts on it: zero when there is none.
	Remaining time.Duration `json:"remaining"`
}

// Pending reports whether r is a request still pending.
func (r TransferRequest) Pending() bool { return r.Remaining > 0 }

// Transferer is implemented by a Store that can hand a lease to a chosen
// candidate: see Elector.Transfer, RequestTransfer and Config.Priority.
// Every store of this module implements it, and leadertest.TestStore
// checks it where a store does. Times are judged on the store's clock, as
// for Store.
//
// A Transferer's Acquire that does not grant also enlists its candidate,
// as Enlist(ctx, name, c, EnlistFactor*ttl) would, in the same round trip
// (a failed Acquire may or may not have enlisted). So a follower whose
// attempts come at least once per TTL stays enlisted at no cost, and the
// Elector calls Enlist only when its attempts are further apart.
type Transferer interface {
	// Enlist records that c campaigns for name, with c.Priority, until
	// ttl has passed unless c enlists again; enlisting again replaces
	// the entry of c.Token. A store may also remove the holder's entry
	// when it releases the lease (the PostgreSQL stores do, so that a
	// leader that lets go queues behind the candidates that waited): a
	// candidate that campaigns enlists again at its next attempt.
	Enlist(ctx context.Context, name string, c Candidate, ttl time.Duration) error

	// Withdraw removes the entry of token from name's candidates, if
	// there is one.
	Withdraw(ctx context.Context, name, token string) error

	// Candidates lists name's enlisted candidates whose entries have not
	// run out, in any order.
	Candidates(ctx context.Context, name string) ([]Candidate, error)

	// RequestTransfer records req as name's pending request (replacing
	// any earlier one) until ttl has passed, a grant or ReleaseTo ends
	// it, or a request with ttl 0 clears it; Acquire, Renew and Observe
	// report it in Lease.Transfer. It returns the lease as it stands
	// after the call, and an error wrapping ErrNoLeader if the lease is
	// not held (req is then not recorded).
	RequestTransfer(ctx context.Context, name string, req TransferRequest, ttl time.Duration) (Lease, error)

	// ReleaseTo does what Store.Release does, and reserves the freed
	// lease for successor (by its token) until hold has passed: meanwhile
	// Acquire grants it to successor alone, with the next term and
	// reason as its Lease.Reason, and reports it to every other candidate
	// as not held, with Successor and Reserved set. Once hold has passed
	// it is an ordinary released lease. It ends any pending request.
	// reason is GrantTransfer or GrantPriority.
	ReleaseTo(ctx context.Context, name, token string, term uint64, successor Candidate, reason GrantReason, hold time.Duration) error
}

// HandoverWatcher is implemented by a FreeWatcher that can tell a
// handover (Transferer.ReleaseTo) from a release: it wakes the successor
// at once, and the other candidates only if the successor has not taken
// the lease by the end of its reservation. A handover then costs one
// attempt, the successor's, where a release costs one per follower, all
// at the same instant, which on a busy machine delays the successor's.
// The Elector's followers watch with WatchFreeFor where the store offers
// it.
type HandoverWatcher interface {
	// WatchFreeFor is FreeWatcher.WatchFree for the candidate c: the
	// channel receives a value soon after the lease for name is released,
	// or handed over to c (by c.Token), or handed over to another
	// candidate whose reservation has then run out without a grant. A
	// handover to another candidate that takes the lease in time does
	// not wake it. Values are coalesced and may be spurious. The channel
	// is closed after ctx ends.
	WatchFreeFor(ctx context.Context, name string, c Candidate) (<-chan struct{}, error)
}

// HandoverPreparer is implemented by a Transferer that can have a
// handover's successor wait on the store for the release, so that the
// successor's grant runs as the release commits, with no notification and
// no round trip of the successor's between them. The Elector prepares each
// handover on a store that offers it before its leadership ends, and hands
// over with PreparedHandover.Commit instead of Transferer.ReleaseTo; a
// preparation that fails, or that the successor does not answer, costs the
// handover only that speed. Both PostgreSQL stores implement it.
type HandoverPreparer interface {
	// PrepareHandover tells successor that name's lease, held by token
	// under term, is about to be handed to it. The successor's next
	// Acquire of name then waits on the store until the handover is
	// committed or aborted (for at most a bound that the store
	// documents, after which it is an ordinary attempt). It changes
	// nothing of the lease, which stays held and can be renewed.
	// PrepareHandover returns once the successor waits, or once wait has
	// passed (the handover works either way). The caller must end the
	// returned handover with Commit or Abort.
	PrepareHandover(ctx context.Context, name, token string, term uint64, successor Candidate, wait time.Duration) (PreparedHandover, error)
}

// PreparedForChecker is implemented by a HandoverPreparer whose
// successors' stores know, as the preparation's wake-up comes, that a
// handover was prepared for them. A follower that sits out after its own
// tenure (see Run) ignores wake-ups, unless the lease is released and
// reserved for it; a preparation releases nothing yet, so the Elector asks
// PreparedFor too, and a candidate that led a moment ago still waits for
// the handover prepared for it. Both PostgreSQL stores implement it.
type PreparedForChecker interface {
	// PreparedFor reports whether a handover of name was prepared for
	// c, and c's next Acquire of name will wait for it.
	PreparedFor(name string, c Candidate) bool
}

// PreparedHandover is a handover that HandoverPreparer prepared.
type PreparedHandover interface {
	// Commit does what Transferer.ReleaseTo does for the prepared
	// handover, and then lets the successor's waiting Acquire run, which
	// is granted the lease with the next term. A store may make that
	// grant in the release itself, to the successor's waiting session
	// (the PostgreSQL advisory store does), which its Acquire then
	// claims; a grant the successor cannot claim (it went meanwhile)
	// leaves the lease reserved for it until hold has passed, and then
	// as one whose holder went without a release. It returns an error
	// wrapping ErrLeaseLost if the lease was not held by the token under
	// the term any more. A PreparedHandover is used once: after Commit,
	// Commit fails and Abort does nothing.
	Commit(ctx context.Context, reason GrantReason, hold time.Duration) error

	// Abort ends the preparation without releasing anything: a waiting
	// Acquire of the successor runs at once and finds the lease as it
	// stands. After Commit or Abort it does nothing.
	Abort()
}

// HandoverStager is implemented by a PreparedHandover that can run its
// release ahead of Commit. The Elector stages a prepared handover once
// its leadership has ended and before OnDemoted runs, so that the
// release's work leaves the leaderless gap between the old leader's
// OnDemoted and the successor's OnElected: Commit then only makes the
// staged release visible. Both PostgreSQL stores implement it.
type HandoverStager interface {
	// Stage runs the release that Commit would make for reason and hold,
	// without making it visible: the lease stays held, nobody sees it
	// released, and the successor waits on as before. Renewals fail from
	// then on (the leadership has ended). Commit, with the same reason
	// and hold, then makes it visible; Abort undoes it. A store may
	// decline to stage (Stage returns nil, and Commit releases as it
	// would have); it must, when staging would hold up the old term's
	// own writes (fenced writes, which OnDemoted may wait for) until
	// Commit. Stage bounds its work by ctx's deadline without ending the
	// lease: the lease stays held until Commit or Abort, since OnDemoted
	// has not run yet (a store whose lease lives with a connection bounds
	// the work on the server, and closes the connection only once the
	// server has not answered well past the deadline). If Stage fails, the handover is as it was before the call
	// (prepared, not staged), or, if the store cannot tell, the lease is
	// lost: Commit then returns an error wrapping ErrLeaseLost. Stage is
	// called at most once, before Commit or Abort.
	Stage(ctx context.Context, reason GrantReason, hold time.Duration) error
}

// EnlistFactor is how many TTLs a candidate's entry among a name's
// candidates lasts when a Transferer's Acquire enlists it (see
// Transferer), and when the Elector enlists: an entry outlives two missed
// refreshes, and a candidate that stopped without withdrawing (killed)
// drops out within it.
const EnlistFactor = 3

// Errors of transfers.
var (
	// ErrNoLeader is returned by RequestTransfer and Elector.Transfer
	// when nobody leads the name: there is nothing to hand over.
	ErrNoLeader = errors.New("leader: nobody leads")

	// ErrNoCandidate is returned by RequestTransfer and Elector.Transfer
	// when no campaigning candidate (other than the leader) has the ID
	// asked for, or, for the best candidate, when none campaigns. Nothing
	// has changed when it is returned.
	ErrNoCandidate = errors.New("leader: no such candidate")

	// ErrTransferNotTaken is returned by RequestTransfer and
	// Elector.Transfer when the leader handed over, but the successor did
	// not take the lease within its reservation (it stopped, or cannot
	// reach the store): the lease then became an ordinary released one,
	// which any candidate may take.
	ErrTransferNotTaken = errors.New("leader: the successor did not take the lease")
)

// DefaultTransferTimeout is how long RequestTransfer's request stays
// pending when its context has no deadline.
const DefaultTransferTimeout = 30 * time.Second

// RequestTransfer asks the leader of name on store to hand over, and
// waits until it has: to the candidate whose ID is to, or, when to is "",
// to the best candidate (the highest Config.Priority; among equals, any).
// It needs no Elector, so any process may call it (the leader command's
// transfer subcommand does). The store must implement Transferer.
//
// The leader acts on the request at its next renewal (within its
// RenewInterval): it cancels its leader context, waits for OnDemoted and
// OnElected to return, and releases the lease reserved for the successor,
// which takes it at once with the next term while the other candidates
// wait (see Elector.Transfer). RequestTransfer returns the lease as the
// successor holds it. It returns an error wrapping ErrNoLeader if nobody
// leads, ErrNoCandidate if no other candidate campaigns with the ID to (or
// at all), ErrTransferNotTaken if the successor did not take the lease
// within its reservation (or nobody holds the term granted to it a second
// later), and ctx.Err() if ctx ends first. The request
// stays pending until ctx's deadline, or for DefaultTransferTimeout; if it
// lapses, or the leader declines it (it found no successor), or its
// Elector predates transfers, RequestTransfer fails saying so.
func RequestTransfer(ctx context.Context, store Store, name, to string) (Lease, error) {
	ts, ok := store.(Transferer)
	if !ok {
		return Lease{}, fmt.Errorf("leader: transfer %q: the store (%T) cannot hand a lease over: %w", name, store, errors.ErrUnsupported)
	}
	cur, err := store.Observe(ctx, name)
	if err != nil {
		return Lease{}, fmt.Errorf("leader: transfer %q: %w", name, err)
	}
	if !cur.Held() {
		return cur, fmt.Errorf("leader: transfer %q: %w", name, ErrNoLeader)
	}
	cands, err := ts.Candidates(ctx, name)
	if err != nil {
		return cur, fmt.Errorf("leader: transfer %q: listing candidates: %w", name, err)
	}
	if _, err := chooseSuccessor(cands, cur.HolderID, "", to, nil); err != nil {
		return cur, fmt.Errorf("leader: transfer %q: %w", name, err)
	}
	ttl := DefaultTransferTimeout
	if d, ok := ctx.Deadline(); ok {
		ttl = max(time.Until(d), time.Millisecond)
	}
	// Watch first, so that no grant goes unseen between the request and
	// the wait.
	wctx, stop := context.WithCancel(ctx)
	defer stop()
	wake, err := store.Watch(wctx, name)
	if err != nil {
		wake = nil // wait by polling alone
	}
	cur, err = ts.RequestTransfer(ctx, name, TransferRequest{To: to, Reason: GrantTransfer}, ttl)
	if err != nil {
		return cur, fmt.Errorf("leader: transfer %q: %w", name, err)
	}
	return awaitSuccessor(ctx, store, wake, name, cur.Term, to, true)
}

// awaitSuccessor waits until name's lease on store has been granted after
// term, and returns it: with an error wrapping ErrTransferNotTaken if to is
// not "" and another candidate holds it, if it was released and its
// reservation ran out with nobody taking it, or if a later term stays
// unheld (see below). Unless requested is false, the handover had been
// requested of the holder of term, and a request that lapses or is cleared
// while term still holds fails the wait. It waits on wake, and polls as
// well: without wake (nil) every few milliseconds at first, then less
// often; with it, from 25 ms on, so that its own statements do not compete
// with the successor's grant. For the same reason it looks awakeSettle
// after a wake-up, not at once: the release wakes it too, as the
// successor's grant is about to run.
//
// A later term that nobody holds is a grant in progress while it is
// reserved for its successor, and for grantSettle after it was first seen
// unheld: a store may record a grant before its successor holds it (the
// advisory strategy's staged release names the successor's session as it
// commits, and reserves the lease for it until that session has claimed
// it), so it is looked at again, from awakeSettle on and less and less
// often. A later term still unheld after that fails the wait: its
// successor never took it, or lost it already.
func awaitSuccessor(ctx context.Context, store Store, wake <-chan struct{}, name string, term uint64, to string, requested bool) (Lease, error) {
	poll, first := time.Millisecond, time.Duration(0)
	if wake != nil {
		poll, first = 25*time.Millisecond, 25*time.Millisecond
	}
	timer := time.NewTimer(first)
	defer timer.Stop()
	due := time.Now().Add(first) // when the timer fires
	sawReserved := false
	var unheld time.Time // when a later term was first seen unheld
	for {
		select {
		case <-ctx.Done():
			return Lease{}, fmt.Errorf("leader: transfer %q: waiting for the successor: %w", name, ctx.Err())
		case _, open := <-wake:
			if !open {
				wake = nil
			}
			if soon := time.Now().Add(awakeSettle); soon.Before(due) {
				timer.Reset(awakeSettle)
				due = soon
			}
			continue
		case <-timer.C:
		}
		l, err := store.Observe(ctx, name)
		switch {
		case err != nil:
			if ctx.Err() != nil {
				return l, fmt.Errorf("leader: transfer %q: waiting for the successor: %w", name, ctx.Err())
			}
		case l.Term > term && l.Held():
			if to != "" && l.HolderID != to {
				return l, fmt.Errorf("leader: transfer %q: %s holds it with term %d, not %s: %w", name, l.HolderID, l.Term, to, ErrTransferNotTaken)
			}
			return l, nil
		case l.Term > term:
			// Granted, and perhaps not yet taken: look again soon, from
			// awakeSettle on, unless it has stayed unheld too long.
			if unheld.IsZero() {
				unheld, poll = time.Now(), awakeSettle
			}
			if l.Successor == "" && time.Since(unheld) >= grantSettle {
				return l, fmt.Errorf("leader: transfer %q: term %d was granted after term %d, but nobody holds it: its successor never took it, or lost it already: %w", name, l.Term, term, ErrTransferNotTaken)
			}
		case l.Successor != "":
			sawReserved = true
		case !l.Held() && (sawReserved || !requested):
			return l, fmt.Errorf("leader: transfer %q: released with term %d; nobody took it within its reservation: %w", name, term, ErrTransferNotTaken)
		case !l.Held():
			// Released without a reservation: the leader stopped, or
			// declined and released (an Elector that predates
			// transfers does not release on request).
			return l, fmt.Errorf("leader: transfer %q: the leader released term %d without handing it over", name, term)
		case requested && !l.Transfer.Pending():
			return l, fmt.Errorf("leader: transfer %q: %s, leading with term %d, did not hand over before the request lapsed (it found no candidate to hand over to, or its version predates transfers)", name, l.HolderID, term)
		}
		timer.Reset(poll)
		due = time.Now().Add(poll)
		poll = min(poll*2, 100*time.Millisecond)
	}
}

// awakeSettle is how long after a wake-up awaitSuccessor looks at the
// lease: about what a successor's grant takes, woken by the same release.
const awakeSettle = 5 * time.Millisecond

// grantSettle is how long awaitSuccessor waits for a later term it sees
// unheld, and not reserved, to be held before it fails: far longer than a
// successor takes to take a grant recorded for it, even on a busy machine.
// It delays only the failure of a transfer whose successor never took the
// lease, or lost it at once.
const grantSettle = time.Second

// chooseSuccessor picks the candidate to hand over to among cands, leaving
// out the holder's token (or, when holderToken is "", every candidate with
// the holder's ID): the one whose ID is to, or, when to is "", the one with
// the highest priority, the first of equals in cands. If above is not nil,
// the successor's priority must be above *above. It returns an error
// wrapping ErrNoCandidate, which lists the candidates, when none fits.
func chooseSuccessor(cands []Candidate, holderID, holderToken, to string, above *int) (Candidate, error) {
	others := slices.DeleteFunc(slices.Clone(cands), func(c Candidate) bool {
		if holderToken != "" {
			return c.Token == holderToken
		}
		return c.ID == holderID
	})
	fits := others
	if to != "" {
		fits = slices.DeleteFunc(slices.Clone(others), func(c Candidate) bool { return c.ID != to })
	}
	if above != nil {
		fits = slices.DeleteFunc(slices.Clone(fits), func(c Candidate) bool { return c.Priority <= *above })
	}
	if len(fits) == 0 {
		ids := make([]string, 0, len(others))
		for _, c := range others {
			ids = append(ids, fmt.Sprintf("%s (priority %d)", c.ID, c.Priority))
		}
		list := "none campaigns besides the leader"
		if len(ids) > 0 {
			list = "campaigning: " + strings.Join(ids, ", ")
		}
		switch {
		case to != "":
			return Candidate{}, fmt.Errorf("%w: no candidate besides the leader has ID %q (%s)", ErrNoCandidate, to, list)
		case above != nil:
			return Candidate{}, fmt.Errorf("%w: no candidate has a priority above %d (%s)", ErrNoCandidate, *above, list)
		}
		return Candidate{}, fmt.Errorf("%w: %s", ErrNoCandidate, list)
	}
	return slices.MaxFunc(fits, func(a, b Candidate) int { return cmp.Compare(a.Priority, b.Priority) }), nil
}
