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

--json prints one JSON object:
  {"name": "...", "leader": "ID" or null, "held": true|false, "term": N,
   "acquired_at": "RFC 3339" or null, "expires_at": "RFC 3339" or null,
   "remaining_seconds": N}
"leader" is null when no one holds the lease; "term" is then the last term
granted (0 if never).

On PostgreSQL, give the --strategy the election's candidates run with: each
strategy keeps its own records, so with the other one the election shows no
leader (status then adds a note on stderr if the other strategy knows the
election). With --strategy advisory, "expires" is when PostgreSQL would end
the leader's session if its heartbeats stopped; each heartbeat pushes it on.

Exit codes: 0 printed (whether or not anyone leads), 1 store error, 2 usage
error (or --strategy advisory on a server that cannot serve it).
`,
}

var watchCommand = &command{
	name:     "watch",
	synopsis: "leader watch --name NAME [--json] [flags]",
	summary:  "print a line each time the leader of an election changes",
	help: `
Prints the election's leader now, then a line each time it changes (a new
holder, a new term, or no holder), until interrupted. Changes are noticed
from the store's wake-ups and, for expiries, at the expiry the store
reported. --json prints each line as a JSON object with the keys of
"leader status --json" plus "time" (when the change was seen, this host's
clock). On PostgreSQL, give the --strategy the election's candidates run
with, as for status.

Exit codes: 0 interrupted, 1 store error at start, 2 usage error (or
--strategy advisory on a server that cannot serve it).
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
}

func (o *statusOptions) flags(cmd string) *flag.FlagSet {
	fs := flag.NewFlagSet(cmd, flag.ContinueOnError)
	fs.Var((*requiredString)(&o.name), "name", "the election `NAME`")
	fs.BoolVar(&o.json, "json", false, "print JSON")
	registerStrategy(fs, &o.strategy, "the PostgreSQL strategy the election's candidates use: lease or advisory (each keeps its own\n"+
		"records: with the wrong one, the election shows no leader)")
	if cmd == "watch" {
		fs.DurationVar(&o.interval, "poll", 2*time.Second, "also look this often while no one leads, for stores without wake-ups")
	}
	o.commonOptions.register(fs, "warn")
	return fs
}

// setup parses the flags and opens the store.
func (o *statusOptions) setup(a *app, ctx context.Context, cmd *command, args []string) (*openedStore, *slog.Logger, func(error) int, int, bool) {
	fs := o.flags(cmd.name)
	if _, code, ok := a.parse(cmd, fs, args, false); !ok {
		return nil, nil, nil, code, false
	}
	rawStore, storeErr := o.storeURL(a, fs)
	red := redact.ForURL(rawStore)
	fail := func(err error) int { return a.fail(cmd.name, red, err) }
	log, err := o.logger(a.stderr, red)
	if err != nil {
		return nil, nil, nil, fail(err), false
	}
	if o.name == "" {
		return nil, nil, nil, fail(usagef("missing --name: the election to show")), false
	}
	if storeErr != nil {
		return nil, nil, nil, fail(storeErr), false
	}
	spec, err := parseStoreURL(rawStore)
	if err != nil {
		return nil, nil, nil, fail(err), false
	}
	if spec, err = withStrategy(spec, o.strategy); err != nil {
		return nil, nil, nil, fail(err), false
	}
	store, err := openStore(ctx, spec, log)
	if err != nil {
		return nil, nil, nil, fail(err), false
	}
	return store, log, fail, 0, true
}

func runStatus(a *app, ctx context.Context, args []string) int {
	var o statusOptions
	store, _, fail, code, ok := o.setup(a, ctx, statusCommand, args)
	if !ok {
		return code
	}
	defer store.Close()
	lease, err := store.Observe(ctx, o.name)
	if err != nil {
		return fail(fmt.Errorf("reading the lease of %q: %w", o.name, err))
	}
	if o.json {
		writeJSON(a.stdout, leaseJSON(o.name, lease, time.Time{}))
	} else {
		printStatus(a.stdout, o.name, lease, time.Now())
	}
	if note := strategyHint(ctx, store, o.name, lease); note != "" {
		fmt.Fprintf(a.stderr, "leader status: note: %s\n", note)
	}
	return exitOK
}

// strategyHint returns a note for people when the election shows no leader
// under the store's PostgreSQL strategy but the other strategy has a leader
// for it, or has records of it while this one has none: the usual cause is
// status or watch run without the --strategy of the election's candidates.
// It returns "" otherwise, and when the other strategy cannot be read.
func strategyHint(ctx context.Context, store *openedStore, name string, l leader.Lease) string {
	if l.Held() || store.observeOther == nil {
		return ""
	}
	ctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	other, err := store.observeOther(ctx, name)
	if err != nil {
		return ""
	}
	otherStrategy := strategyAdvisory
	if store.strategy == strategyAdvisory {
		otherStrategy = strategyLease
	}
	const advice = "give status and watch the --strategy that the election's candidates run with"
	switch {
	case other.Held():
		return fmt.Sprintf("this shows the %s strategy's records; under --strategy %s, %q is led by %s (term %d): %s",
			store.strategy, otherStrategy, name, other.HolderID, other.Term, advice)
	case l.Term == 0 && other.Term > 0:
		return fmt.Sprintf("%q was never granted under the %s strategy, but has records under --strategy %s (last term %d): %s",
			name, store.strategy, otherStrategy, other.Term, advice)
	}
	return ""
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
}

func leaseJSON(name string, l leader.Lease, seen time.Time) statusJSON {
	out := statusJSON{Name: name, Term: l.Term, Held: l.Held()}
	if !seen.IsZero() {
		out.Time = &seen
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
		if l.Term == 0 {
			fmt.Fprintf(w, "leader    none (never granted)\n")
		} else {
			fmt.Fprintf(w, "leader    none (last term %d)\n", l.Term)
		}
		return
	}
	fmt.Fprintf(w, "leader    %s\n", l.HolderID)
	fmt.Fprintf(w, "term      %d\n", l.Term)
	if !l.AcquiredAt.IsZero() {
		fmt.Fprintf(w, "since     %s (%s ago)\n", l.AcquiredAt.Format(time.RFC3339Nano), roundDuration(now.Sub(l.AcquiredAt)))
	}
	fmt.Fprintf(w, "expires   %s (in %s)\n", l.ExpiresAt.Format(time.RFC3339Nano), roundDuration(l.Remaining))
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

// leaseKey identifies what watch reports as a change.
type leaseKey struct {
	holder string
	term   uint64
	held   bool
}

func keyOf(l leader.Lease) leaseKey {
	if !l.Held() {
		return leaseKey{term: l.Term}
	}
	return leaseKey{holder: l.HolderID, term: l.Term, held: true}
}

func runWatch(a *app, ctx context.Context, args []string) int {
	var o statusOptions
	store, log, fail, code, ok := o.setup(a, ctx, watchCommand, args)
	if !ok {
		return code
	}
	defer store.Close()

	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	wake, err := store.Watch(wctx, o.name)
	if err != nil {
		log.Warn("store wake-ups unavailable; looking at expiries and every --poll", slog.Any("error", err))
		wake = nil
	}
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
		lease, err := store.Observe(ctx, o.name)
		now := time.Now()
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
		if !printed {
			if note := strategyHint(ctx, store, o.name, lease); note != "" {
				log.Warn(note)
			}
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
		next := o.interval
		if lease.Held() {
			next = lease.Remaining + 5*time.Millisecond
			if wake == nil {
				next = min(next, o.interval)
			}
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
		fmt.Fprintf(w, "%s leader=none term=%d\n", ts, l.Term)
		return
	}
	fmt.Fprintf(w, "%s leader=%s term=%d expires_at=%s\n", ts, l.HolderID, l.Term, l.ExpiresAt.Format(time.RFC3339Nano))
}
