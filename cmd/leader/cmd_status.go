//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/cmd/leader/internal/redact"
)

var statusCommand = &command{
	name:     "status",
	synopsis: "leader status --name NAME [--json] [flags]",
	summary:  "show the current leader of an election",
	help: `
Prints the election's current leader (its ID), the fencing term of its grant,
when it was granted the lease (since) and when the lease runs out unless
renewed (expires), as the store reports them. Times are the store's.

Also how leadership last moved (reason: release, expiry, transfer or
priority), the leader's --priority when not 0, and a pending request that
it hand over ("leader transfer", or an instance with a higher --priority).
While a lease handed over waits for its successor, the leader is none and
the successor is named.

--json prints one JSON object:
  {"name": "...", "leader": "ID" or null, "held": true|false, "term": N,
   "acquired_at": "RFC 3339" or null, "expires_at": "RFC 3339" or null,
   "remaining_seconds": N, "reason": "release|expiry|transfer|priority|",
   "priority": N, "transfer": {"to": "ID" or null, "reason":
   "transfer|priority", "remaining_seconds": N} or null,
   "successor": "ID" or null, "reserved_seconds": N (with successor)}
"leader" is null when no one holds the lease; "term" is then the last term
granted (0 if never). "reason" is "" for a first grant.

On PostgreSQL an election is elected with one strategy (lease or advisory,
"leader run --strategy"), which the store records: status looks at the
election with that strategy, so it needs no --strategy. Given, --strategy is
used only for an election never elected; if the store records the other
strategy, a note on stderr says so. With the advisory strategy, "expires" is
when PostgreSQL would end the leader's session if its heartbeats stopped;
each heartbeat pushes it on.

Exit codes: 0 printed (whether or not anyone leads), 1 store error, 2 usage
error (or an election of the advisory strategy, or --strategy advisory, on a
server or through a pooler that cannot serve it).
`,
}

var watchCommand = &command{
	name:     "watch",
	synopsis: "leader watch --name NAME [--json] [flags]",
	summary:  "print a line each time the leader of an election changes",
	help: `
Prints the election's leader now, then a line each time it changes (a new
holder, a new term, or no holder; a transfer asked for; a lease handed over
and waiting for its successor), until interrupted. Each line says how
leadership last moved (reason=release, expiry, transfer or priority). Changes are noticed
from the store's wake-ups and, for expiries, at the expiry the store
reported. --json prints each line as a JSON object with the keys of
"leader status --json" plus "time" (when the change was seen, this host's
clock). On PostgreSQL, watch finds the election's strategy in the store, as
status does, and follows the election if it moves to the other strategy.

Exit codes: 0 interrupted, 1 store error at start, 2 usage error (or an
election of the advisory strategy, or --strategy advisory, on a server or
through a pooler that cannot serve it).
`,
}

func init() {
	statusCommand.flags = func() *flag.FlagSet { return new(statusOptions).flags("status") }
	statusCommand.run = runStatus
	watchCommand.flags = func() *flag.FlagSet { return new(statusOptions).flags("watch") }
	watchCommand.run = runWatch
}

type statusOptions struct {
	commonOptions
	name     string
	json     bool
	interval time.Duration
	strategy string
	to       string        // transfer
	timeout  time.Duration // transfer
}

func (o *statusOptions) flags(cmd string) *flag.FlagSet {
	fs := flag.NewFlagSet(cmd, flag.ContinueOnError)
	fs.Var((*requiredString)(&o.name), "name", "the election `NAME`")
	fs.BoolVar(&o.json, "json", false, "print JSON")
	registerStrategy(fs, &o.strategy, "not needed: on PostgreSQL the strategy the store records for the election is used; for an\n"+
		"election never elected, this one (lease or advisory). Kept for scripts: when the store records\n"+
		"the other one, a note on stderr says so")
	describeDefault(fs, "strategy", "the election's own, from the store")
	if cmd == "watch" {
		fs.DurationVar(&o.interval, "poll", 2*time.Second, "also look this often (for a pending transfer, or while no one leads, or for stores without wake-ups)")
	}
	if cmd == "transfer" {
		fs.StringVar(&o.to, "to", "", "hand over to the instance with this `ID` (\"leader status\" shows the leader's)")
		describeDefault(fs, "to", "the best instance: the highest --priority")
		fs.DurationVar(&o.timeout, "timeout", leader.DefaultTransferTimeout, "give up when the leader has not handed over within this long")
	}
	o.commonOptions.register(fs, "warn")
	return fs
}

// setup parses the flags and opens the store, with the strategy the store
// records for the election (see electionView).
func (o *statusOptions) setup(a *app, ctx context.Context, cmd *command, args []string) (*electionView, func(error) int, int, bool) {
	fs := o.flags(cmd.name)
	if _, code, ok := a.parse(cmd, fs, args, false); !ok {
		return nil, nil, code, false
	}
	rawStore, storeErr := o.storeURL(a, fs)
	red := redact.ForURL(rawStore)
	fail := func(err error) int { return a.fail(cmd.name, red, err) }
	log, err := o.logger(a.stderr, red)
	if err != nil {
		return nil, nil, fail(err), false
	}
	if o.name == "" {
		return nil, nil, fail(usagef("missing --name: the election to show")), false
	}
	if storeErr != nil {
		return nil, nil, fail(storeErr), false
	}
	spec, err := parseStoreURL(rawStore)
	if err != nil {
		return nil, nil, fail(err), false
	}
	if spec, err = withStrategy(spec, o.strategy); err != nil {
		return nil, nil, fail(err), false
	}
	spec.election = o.name
	store, err := openStore(ctx, spec, log)
	if err != nil {
		return nil, nil, fail(err), false
	}
	if flagGiven(fs, "strategy") && store.strategy != spec.strategy {
		fmt.Fprintf(a.stderr, "leader %s: note: election %q is elected with the %s strategy, as the store records it: "+
			"showing its leader there, not under --strategy %s (%s finds an election's strategy by itself: leave out --strategy)\n",
			cmd.name, o.name, store.strategy, spec.strategy, cmd.name)
	}
	return &electionView{name: o.name, spec: spec, log: log, store: store}, fail, 0, true
}

// flagGiven reports whether the flag name was set on the command line
// parsed by fs.
func flagGiven(fs *flag.FlagSet, name string) bool {
	given := false
	fs.Visit(func(f *flag.Flag) { given = given || f.Name == name })
	return given
}

// electionView looks at one election for status and watch. On PostgreSQL
// an election is elected with one strategy at a time, which the store
// records: the view uses that strategy's store, and follows the election
// when it moves to the other strategy (or is first elected there), so that
// it never shows "no leader" for an election that is led.
type electionView struct {
	name  string
	spec  storeSpec // spec.election is name
	log   *slog.Logger
	store *openedStore
}

func (v *electionView) Close() { v.store.Close() }

// look returns the election's lease. When the lease is not held under the
// view's strategy and the store now records the other strategy for the
// election, look opens that strategy's store and reads the lease there;
// moved then reports that the view's store changed (a watch of the old one
// is stale).
func (v *electionView) look(ctx context.Context) (l leader.Lease, moved bool, err error) {
	l, err = v.store.Observe(ctx, v.name)
	if err != nil || l.Held() || v.store.strategyOf == nil {
		return l, false, err
	}
	strategy, err := v.store.strategyOf(ctx, v.name)
	if err != nil {
		return l, false, fmt.Errorf("finding the strategy of election %q: %w", v.name, err)
	}
	if strategy == "" || strategy == v.store.strategy {
		return l, false, nil
	}
	next, err := openStore(ctx, v.spec, v.log)
	if err != nil {
		return l, false, err
	}
	v.store.Close()
	v.store = next
	v.log.Info("the election is elected with the other strategy now; looking there", slog.String("strategy", next.strategy))
	l, err = next.Observe(ctx, v.name)
	return l, true, err
}

func runStatus(a *app, ctx context.Context, args []string) int {
	var o statusOptions
	view, fail, code, ok := o.setup(a, ctx, statusCommand, args)
	if !ok {
		return code
	}
	defer view.Close()
	lease, _, err := view.look(ctx)
	if err != nil {
		return fail(fmt.Errorf("reading the lease of %q: %w", o.name, err))
	}
	if o.json {
		writeJSON(a.stdout, leaseJSON(o.name, lease, time.Time{}))
	} else {
		printStatus(a.stdout, o.name, lease, time.Now())
	}
	return exitOK
}

// statusJSON is the JSON form of a lease, for status and watch.
type statusJSON struct {
	Time             *time.Time `json:"time,omitempty"`
	Name             string     `json:"name"`
	Leader           *string    `json:"leader"`
	Held             bool       `json:"held"`
	Term             uint64     `json:"term"`
	AcquiredAt       *time.Time `json:"acquired_at"`
	ExpiresAt        *time.Time `json:"expires_at"`
	RemainingSeconds float64    `json:"remaining_seconds"`
	// Reason is how leadership last moved: release, expiry, transfer,
	// priority, or "" for a first grant.
	Reason   string `json:"reason"`
	Priority int    `json:"priority"`
	// Transfer is a pending request that the leader hand over.
	Transfer *transferJSON `json:"transfer"`
	// Successor is the instance a lease handed over is reserved for,
	// until it takes it (ReservedSeconds more).
	Successor       *string `json:"successor"`
	ReservedSeconds float64 `json:"reserved_seconds,omitempty"`
}

// transferJSON is a pending request to hand over.
type transferJSON struct {
	To               *string `json:"to"` // null: the best instance
	Reason           string  `json:"reason"`
	RemainingSeconds float64 `json:"remaining_seconds"`
}

func leaseJSON(name string, l leader.Lease, seen time.Time) statusJSON {
	out := statusJSON{Name: name, Term: l.Term, Held: l.Held(), Reason: string(l.Reason)}
	if !seen.IsZero() {
		out.Time = &seen
	}
	if l.Successor != "" {
		successor := l.Successor
		out.Successor, out.ReservedSeconds = &successor, l.Reserved.Seconds()
	}
	if l.Held() && l.Transfer.Pending() {
		out.Transfer = &transferJSON{Reason: string(l.Transfer.Reason), RemainingSeconds: l.Transfer.Remaining.Seconds()}
		if to := l.Transfer.To; to != "" {
			out.Transfer.To = &to
		}
	}
	if l.Held() {
		id, acquired, expires := l.HolderID, l.AcquiredAt, l.ExpiresAt
		out.Leader = &id
		if !acquired.IsZero() {
			out.AcquiredAt = &acquired
		}
		if !expires.IsZero() {
			out.ExpiresAt = &expires
		}
		out.RemainingSeconds = l.Remaining.Seconds()
		out.Priority = l.Priority
	}
	return out
}

func writeJSON(w io.Writer, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err) // plain data: cannot fail
	}
	fmt.Fprintf(w, "%s\n", b)
}

func printStatus(w io.Writer, name string, l leader.Lease, now time.Time) {
	fmt.Fprintf(w, "election  %s\n", name)
	if !l.Held() {
		switch {
		case l.Term == 0:
			fmt.Fprintf(w, "leader    none (never granted)\n")
		case l.Successor != "":
			fmt.Fprintf(w, "leader    none: handed over to %s, reserved for it %s more (last term %d)\n", l.Successor, roundDuration(l.Reserved), l.Term)
		default:
			fmt.Fprintf(w, "leader    none (last term %d)\n", l.Term)
		}
		return
	}
	fmt.Fprintf(w, "leader    %s\n", l.HolderID)
	fmt.Fprintf(w, "term      %d\n", l.Term)
	if l.Reason != "" {
		fmt.Fprintf(w, "reason    %s\n", reasonText(l.Reason))
	}
	if l.Priority != 0 {
		fmt.Fprintf(w, "priority  %d\n", l.Priority)
	}
	if !l.AcquiredAt.IsZero() {
		fmt.Fprintf(w, "since     %s (%s ago)\n", l.AcquiredAt.Format(time.RFC3339Nano), roundDuration(now.Sub(l.AcquiredAt)))
	}
	fmt.Fprintf(w, "expires   %s (in %s)\n", l.ExpiresAt.Format(time.RFC3339Nano), roundDuration(l.Remaining))
	if r := l.Transfer; r.Pending() {
		to := "the best instance"
		if r.To != "" {
			to = r.To
		}
		why := "asked for"
		if r.Reason == leader.GrantPriority {
			why = "an instance with a higher priority campaigns"
		}
		fmt.Fprintf(w, "transfer  pending, to %s (%s; %s left)\n", to, why, roundDuration(r.Remaining))
	}
}

// reasonText says how leadership last moved, for status.
func reasonText(r leader.GrantReason) string {
	switch r {
	case leader.GrantRelease:
		return "release (the last leader stopped or resigned)"
	case leader.GrantExpiry:
		return "expiry (the last leader's lease ran out: it died, hung or lost the store)"
	case leader.GrantTransfer:
		return "transfer (the last leader handed over on request)"
	case leader.GrantPriority:
		return "priority (the last leader handed over to a higher priority)"
	}
	return string(r)
}

func roundDuration(d time.Duration) time.Duration {
	switch {
	case d > time.Minute:
		return d.Round(time.Second)
	case d > time.Second:
		return d.Round(100 * time.Millisecond)
	default:
		return d.Round(time.Millisecond)
	}
}

// leaseKey identifies what watch reports as a change: a new holder, term,
// or none; a transfer asked for; a lease handed over, reserved for its
// successor.
type leaseKey struct {
	holder    string
	term      uint64
	held      bool
	transfer  leader.TransferRequest // Remaining zero
	successor string
}

func keyOf(l leader.Lease) leaseKey {
	if !l.Held() {
		return leaseKey{term: l.Term, successor: l.Successor}
	}
	k := leaseKey{holder: l.HolderID, term: l.Term, held: true}
	if l.Transfer.Pending() {
		k.transfer = leader.TransferRequest{To: l.Transfer.To, Reason: l.Transfer.Reason}
	}
	return k
}

func runWatch(a *app, ctx context.Context, args []string) int {
	var o statusOptions
	view, fail, code, ok := o.setup(a, ctx, watchCommand, args)
	if !ok {
		return code
	}
	defer view.Close()
	log := view.log

	// wake is the view's store's wake-ups, subscribed again when the
	// election moves to the other strategy's store.
	var (
		wake      <-chan struct{}
		stopWatch = func() {}
	)
	subscribe := func() {
		stopWatch()
		wctx, cancel := context.WithCancel(ctx)
		stopWatch = cancel
		var err error
		if wake, err = view.store.Watch(wctx, o.name); err != nil {
			log.Warn("store wake-ups unavailable; looking at expiries and every --poll", slog.Any("error", err))
			wake = nil
		}
	}
	subscribe()
	defer func() { stopWatch() }()

	var (
		last    leaseKey
		printed bool
		failing bool
	)
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return exitOK
		case _, open := <-wake:
			if !open {
				wake = nil
				continue
			}
			timer.Stop()
		case <-timer.C:
		}
		lease, moved, err := view.look(ctx)
		now := time.Now()
		if moved {
			subscribe()
		}
		if err != nil {
			if ctx.Err() != nil {
				return exitOK
			}
			if !printed {
				return fail(fmt.Errorf("reading the lease of %q: %w", o.name, err))
			}
			if !failing {
				log.Warn("cannot read the lease; retrying", slog.Any("error", err))
			}
			failing = true
			timer.Reset(time.Second)
			continue
		}
		if failing {
			log.Warn("store reachable again")
			failing = false
		}
		if k := keyOf(lease); !printed || k != last {
			printed, last = true, k
			if o.json {
				writeJSON(a.stdout, leaseJSON(o.name, lease, now))
			} else {
				printWatchLine(a.stdout, lease, now)
			}
		}
		// Look again when the lease runs out unless renewed (a follower's
		// view of an expiry), and every --poll while no one leads or when
		// the store gives no wake-ups.
		// A request to hand over wakes no watcher: --poll finds it.
		next := o.interval
		if lease.Held() {
			next = min(lease.Remaining+5*time.Millisecond, o.interval)
		}
		if next <= 0 {
			next = 2 * time.Second
		}
		timer.Reset(next)
	}
}

func printWatchLine(w io.Writer, l leader.Lease, now time.Time) {
	ts := now.Format("2006-01-02T15:04:05.000Z07:00")
	if !l.Held() {
		if l.Successor != "" {
			fmt.Fprintf(w, "%s leader=none term=%d handed_to=%s\n", ts, l.Term, l.Successor)
			return
		}
		fmt.Fprintf(w, "%s leader=none term=%d\n", ts, l.Term)
		return
	}
	line := fmt.Sprintf("%s leader=%s term=%d expires_at=%s", ts, l.HolderID, l.Term, l.ExpiresAt.Format(time.RFC3339Nano))
	if l.Reason != "" {
		line += " reason=" + string(l.Reason)
	}
	if r := l.Transfer; r.Pending() {
		to := r.To
		if to == "" {
			to = "best"
		}
		line += fmt.Sprintf(" transfer=pending transfer_to=%s transfer_reason=%s", to, r.Reason)
	}
	fmt.Fprintln(w, line)
}
