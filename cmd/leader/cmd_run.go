//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/cmd/leader/internal/redact"
	"github.com/leaderelect/leader/leaderprom"
)

var runCommand = &command{
	name:        "run",
	synopsis:    "leader run --name NAME [flags] -- CMD [ARGS...]",
	summary:     "run a command only while this instance leads the election",
	runsCommand: true,
	help: `
Campaigns in the election NAME and, while this instance leads, runs CMD with
LEADER_NAME, LEADER_ID, LEADER_TERM (the fencing term, which grows with every
new leader) and LEADER_HELD=1 added to its environment. Its standard input is
/dev/null; its output goes to this command's.

When leadership is lost, the command's whole process group gets SIGTERM, then
SIGKILL after --grace, and "leader run" waits until it is gone before the
lease can pass to another instance: --grace is checked against --ttl so that
the command always ends before the lease could be granted to anyone else.
If "leader run" itself is killed (even with SIGKILL), the command and every
process in its process group are killed at once. If "leader run" is
frozen (SIGSTOP, a cgroup freezer, a debugger), the command's supervisor
stops it as on loss when the lease's stop point passes without a renewal.
"leader run" ignores SIGTSTP (Ctrl-Z), SIGTTIN and SIGTTOU. When this
instance is elected again, the command starts again.

SIGINT or SIGTERM to "leader run" stops the command the same way and hands
the lease over to the best other instance (the highest --priority; among
equals, any), which starts its command at once while the others wait; then
it exits. If no other instance campaigns, or the one chosen does not take
the lease within a third of --ttl (it was killed, say), the lease is
released as usual (another instance takes over at once). A second signal kills the command with SIGKILL at once.

--priority ranks instances as successors: an instance whose --priority is
above the leader's asks it to hand over, and the leader does once it has
led for --ttl; equal priorities never move leadership. In a rolling deploy,
give the new release a higher --priority: leadership moves once, to the
first new instance, and stays there. "leader transfer" hands over on
request, from any host.

On PostgreSQL, --strategy chooses how the election is kept:
  lease     (default) a row in the lease table, renewed every TTL/3: a
            leader that dies is replaced when its lease runs out, within
            --ttl. Works through a connection pooler such as PgBouncer.
  advisory  a session advisory lock on a connection of the leader's own: a
            leader that dies is replaced as soon as PostgreSQL notices that
            its connection closed (at once when the process is killed;
            within about --ttl when its host vanishes). Needs PostgreSQL 14
            or later and a direct connection (no PgBouncer in transaction
            mode); refused otherwise, with exit code 125. No TTL orders the
            commands of different hosts then: if PostgreSQL itself ends the
            leader's session (a restart), another host may start its
            command while this one's is still stopping.
LEADER_TERM grows at every grant with either strategy. An election is
elected with one strategy at a time, which the store records and enforces:
while the other strategy holds the election, "leader run" exits 125 without
starting anything, with a message that names both strategies and what to
do ("leader status" and "leader watch" find the strategy themselves). To
move an election to the other strategy, stop every "leader run" of the old
one, then start the new ones: they wait until a TTL after the old leader
released the election, then one of them is elected (with a greater term).

When the command exits on its own, --restart decides:
  never       release the lease and exit with the command's exit code (default)
  on-failure  start it again (after a short backoff) if it failed; exit 0 once it succeeds
  always      start it again after a short backoff, whatever its exit code

Exit codes (as timeout(1), env(1) and "docker run": 125 to 127 are leader's):
  0        stopped by SIGINT/SIGTERM (command stopped, lease released), or
           the command exited with 0
  N        the command's exit code, when it exited on its own (--restart never)
  128+N    the command was killed by signal N (not sent by "leader run")
  125      "leader run" itself failed: a usage error (bad flags or arguments,
           no store, --strategy advisory on a server that cannot serve it;
           nothing was started), a store that refused this instance before
           it ever campaigned (the election is held with the other
           strategy, tables never migrated, a wrong password: the message
           says what to do; nothing was started), or a runtime error (the
           store cannot be opened or reached, the command cannot be
           supervised)
  126      the command was found but could not be executed
  127      the command was not found
A command that itself exits with 125 to 127 cannot be told from these.
`,
}

func init() {
	runCommand.flags = func() *flag.FlagSet { return new(runOptions).flags() }
	runCommand.run = runRun
}

type runOptions struct {
	commonOptions
	name     string
	id       string
	ttl      time.Duration
	grace    time.Duration
	restart  string
	http     string
	strategy string
	priority int
}

func (o *runOptions) flags() *flag.FlagSet {
	fs := flag.NewFlagSet("run", flag.ContinueOnError)
	fs.Var((*requiredString)(&o.name), "name", "the election `NAME`: instances with one name on one store elect one leader")
	fs.StringVar(&o.id, "id", "", "this instance's `ID`, shown as the leader by status")
	describeDefault(fs, "id", "<hostname>-<pid>")
	fs.DurationVar(&o.ttl, "ttl", leader.DefaultTTL, fmt.Sprintf("lease length: a crashed leader is replaced within about this long (%v to %v)", leader.MinTTL, leader.MaxTTL))
	fs.DurationVar(&o.grace, "grace", 0, "time between SIGTERM and SIGKILL when the command must stop; at most about\nTTL×0.28 minus a kill margin")
	describeDefault(fs, "grace", fmt.Sprintf("TTL/5 minus the kill margin: %v for the default --ttl", defaultGrace(leader.DefaultTTL)))
	fs.IntVar(&o.priority, "priority", 0, fmt.Sprintf("this instance's priority as a successor (see above; %d to %d)", leader.MinPriority, leader.MaxPriority))
	fs.StringVar(&o.restart, "restart", restartNever, "when the command exits on its own: never, on-failure or always")
	fs.StringVar(&o.http, "http", "", "serve /healthz, /leader and /metrics on `ADDR` (a bare :PORT listens on 127.0.0.1)")
	describeDefault(fs, "http", "no HTTP server")
	registerStrategy(fs, &o.strategy, "PostgreSQL strategy: lease or advisory (see above); one per election: while the\nother one holds the election, this instance is refused (exit code 125)")
	o.commonOptions.register(fs, "info")
	return fs
}

// killMargin is the part of Config.StopGrace kept for the SIGKILL itself and
// for making sure the group is gone, after --grace.
func killMargin(ttl time.Duration) time.Duration {
	return min(250*time.Millisecond, ttl/10)
}

// defaultGrace is --grace when not given: the Elector's default StopGrace
// (TTL/5) less the kill margin.
func defaultGrace(ttl time.Duration) time.Duration {
	return max(ttl/5-killMargin(ttl), 0)
}

func runRun(a *app, ctx context.Context, args []string) int {
	ignoreJobControl()
	var o runOptions
	fs := o.flags()
	argv, code, ok := a.parse(runCommand, fs, args, true)
	if !ok {
		return code
	}
	graceSet := false
	fs.Visit(func(f *flag.Flag) { graceSet = graceSet || f.Name == "grace" })
	if !graceSet {
		o.grace = defaultGrace(o.ttl)
	}

	rawStore, storeErr := o.storeURL(a, fs)
	red := redact.ForURL(rawStore)
	fail := func(err error) int { return a.fail("run", red, err) }
	log, err := o.logger(a.stderr, red)
	if err != nil {
		return fail(err)
	}
	if o.name == "" {
		return fail(usagef("missing --name: the election to campaign in"))
	}
	switch o.restart {
	case restartNever, restartOnFailure, restartAlways:
	default:
		return fail(usagef("--restart %q: want never, on-failure or always", o.restart))
	}
	httpAddr, err := listenAddr(o.http)
	if err != nil {
		return fail(err)
	}

	// The Elector runs until the command is done with, or a signal ends
	// ctx: then a leader hands over to the best other instance
	// (Config.HandOverOnStop) and Run returns.
	runCtx, stopRun := context.WithCancel(ctx)
	defer stopRun()
	var (
		exitMu   sync.Mutex
		exitCode = exitOK
	)
	runner := &commandRunner{
		argv:    argv,
		name:    o.name,
		grace:   o.grace,
		restart: o.restart,
		log:     log.With(slog.String("election", o.name)),
		finish: func(code int) {
			exitMu.Lock()
			exitCode = code
			exitMu.Unlock()
			stopRun()
		},
	}
	// The Elector's record of a refusal that Run returns is left out: it
	// is printed once, below, as this command's last word.
	var elector *leader.Elector
	quiet := func() bool { return elector != nil && elector.Status().LastContact.IsZero() }
	cfg := leader.Config{
		Name:     o.name,
		ID:       o.id,
		TTL:      o.ttl,
		Priority: o.priority,
		// SIGINT/SIGTERM hands over rather than releases: the best other
		// instance starts at once while the others wait.
		HandOverOnStop: true,
		StopGrace:      o.grace + killMargin(o.ttl),
		Logger:         slog.New(refusalFilter{Handler: log.Handler(), quiet: quiet}),
		OnElected:      runner.onElected,
		OnDemoted:      runner.onDemoted,
	}
	// Refuse bad settings before opening anything.
	if err := validateConfig(cfg); err != nil {
		return fail(configUsageError(err, o.ttl, o.grace))
	}
	if storeErr != nil {
		return fail(storeErr)
	}
	spec, err := parseStoreURL(rawStore)
	if err != nil {
		return fail(err)
	}
	if spec, err = withStrategy(spec, o.strategy); err != nil {
		return fail(err)
	}

	var registry *prometheus.Registry
	if httpAddr != "" {
		registry = prometheus.NewRegistry()
		m, err := leaderprom.New(registry)
		if err != nil {
			return fail(err)
		}
		cfg.Metrics = m
	}

	store, err := openStore(ctx, spec, log)
	if err != nil {
		return fail(err)
	}
	defer store.Close()
	runner.fencePath = store.fencePath(o.name)

	// The Elector gets the store itself, with every optional interface it
	// has (hand-overs, free-only wake-ups, batch renewals, loss notices).
	elector, err = leader.New(store.Store, cfg)
	if err != nil {
		return fail(configUsageError(err, o.ttl, o.grace))
	}
	runner.id = elector.Config().ID
	runner.stopAt = func() time.Time { return elector.Status().StopAt }
	runner.poll = elector.Config().RenewInterval / 4

	if httpAddr != "" {
		srv, err := serveHTTP(httpAddr, elector, registry, log)
		if err != nil {
			return fail(err)
		}
		defer srv.shutdown()
	}

	// The first SIGINT/SIGTERM ends ctx (see dispatch); a second one kills
	// the command at once. Both are counted here, from the start, so that
	// a quick second signal is not lost.
	signals := make(chan os.Signal, 2)
	signal.Notify(signals, os.Interrupt, syscall.SIGTERM)
	finished := make(chan struct{})
	var watcher sync.WaitGroup
	defer watcher.Wait()
	defer close(finished)
	defer signal.Stop(signals)
	watcher.Go(func() {
		for count := 0; ; {
			select {
			case <-signals:
				if count++; count == 2 {
					log.Warn("second signal: killing the command")
					runner.kill()
				}
			case <-finished:
				return
			}
		}
	})

	// Which instances this one competes with is the one thing a wrong store
	// gets silently wrong: say it at every start, at the default level.
	attrs := []any{slog.String("store", store.display), slog.String("scope", spec.scope()),
		slog.String("election", o.name), slog.String("id", runner.id)}
	if store.strategy != "" {
		attrs = append(attrs, slog.String("strategy", store.strategy))
	}
	attrs = append(attrs, slog.Duration("ttl", o.ttl), slog.Duration("grace", o.grace))
	log.Info("electing", attrs...)
	if err := elector.Run(runCtx); err != nil {
		if conflict := strategyConflict(err); conflict != nil {
			return fail(conflict)
		}
		return fail(err)
	}
	exitMu.Lock()
	defer exitMu.Unlock()
	return exitCode
}

// validateConfig runs leader.New's checks on cfg without a store.
func validateConfig(cfg leader.Config) error {
	_, err := leader.New(noStore{}, cfg)
	return err
}

// configUsageError turns a *leader.ConfigError into a usage error that names
// the flag, not the Config field.
func configUsageError(err error, ttl, grace time.Duration) error {
	var ce *leader.ConfigError
	if !errors.As(err, &ce) {
		return err
	}
	switch ce.Field {
	case "Name":
		return usagef("--name %q %s", ce.Value, ce.Rule)
	case "ID":
		return usagef("--id %q %s", ce.Value, ce.Rule)
	case "TTL":
		return usagef("--ttl %v %s", ce.Value, ce.Rule)
	case "Priority":
		return usagef("--priority %v %s", ce.Value, ce.Rule)
	case "StopGrace":
		// The defaults New fills in: RenewInterval TTL/3, DriftMargin TTL/20.
		limit := ttl - 2*(ttl/3) - ttl/20 - killMargin(ttl)
		if limit <= 0 {
			return usagef("--ttl %v is too short for any --grace; use a longer --ttl", ttl)
		}
		return usagef("--grace %v is too long for --ttl %v: the command must be gone before the lease could be granted to another instance, "+
			"so --grace may be at most %v (TTL - 2×renew interval (TTL/3) - drift margin (TTL/20) - %v kill margin); shorten --grace or lengthen --ttl",
			grace, ttl, limit.Round(time.Millisecond), killMargin(ttl))
	default:
		return usagef("invalid settings: %s %s", ce.Field, ce.Rule)
	}
}

// noStore is a Store for validating a Config; it is never called.
type noStore struct{}

var errNoStore = errors.New("no store")

func (noStore) Acquire(context.Context, string, leader.Candidate, time.Duration) (leader.Lease, bool, error) {
	return leader.Lease{}, false, errNoStore
}
func (noStore) Renew(context.Context, string, string, uint64, time.Duration) (leader.Lease, error) {
	return leader.Lease{}, errNoStore
}
func (noStore) Release(context.Context, string, string, uint64) error { return errNoStore }
func (noStore) Observe(context.Context, string) (leader.Lease, error) {
	return leader.Lease{}, errNoStore
}
func (noStore) Watch(context.Context, string) (<-chan struct{}, error) { return nil, errNoStore }
