//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/cmd/leader/internal/fence"
	"github.com/leaderelect/leader/cmd/leader/internal/redact"
	"github.com/leaderelect/leader/cmd/leader/internal/supervise"
)

// defaultWindow is --window for "leader once": more than the minute by which
// hosts' cron daemons may fire apart.
const defaultWindow = 2 * time.Minute

var onceCommand = &command{
	name:        "once",
	synopsis:    "leader once --name NAME [--window D] [flags] -- CMD [ARGS...]",
	summary:     "run a command on one host per firing (for crontabs installed on every host)",
	runsCommand: true,
	help: `
For a crontab installed on every host: at most one host runs CMD for each
firing, even when the hosts' cron daemons and clocks fire up to a minute
apart; on the others "leader once" exits 0 without running it.

The store must be named, with --store or $LEADER_STORE (cron's environment
seldom has it: set it in the crontab line). Every invocation logs at info
level the store and which hosts it elects among, and whether it ran CMD;
cron mails what a job prints, so add --log-level warn to keep only warnings
and errors.

How: the first host to ask takes the election's lease for --window and runs
CMD, renewing the lease (every --window/3) while CMD runs; when CMD ends it
renews the lease one last time for --window instead of releasing it. Any
firing that asks while the lease is held exits 0 at once.

The guarantee, on PostgreSQL: runs never overlap, and a firing runs CMD only
if no run started or ended within the last --window on the store's clock.
So with --window longer than the spread of one firing across your hosts (the
default 2m covers a minute of clock skew and cron delay, with room to spare),
each firing runs once. Keep --window shorter than the schedule's period minus
the run time, or the next firing is skipped too. If the host running CMD dies,
its lease stays held until it runs out: that firing's run is lost, not
repeated elsewhere. If renewals fail (the store is unreachable), CMD is
stopped (SIGTERM, SIGKILL after --grace) before the lease could run out, and
"leader once" exits 125.

On the embedded store (one host), runs never overlap either; but the kernel
frees the lock when "leader once" exits, normally or not, so the window after
a run does not hold there: a later invocation runs again.

On PostgreSQL "leader once" uses the lease strategy: --strategy advisory is
refused, as its lock would be freed when "leader once" exits, and the window
after a run could not hold. An election is elected with one strategy at a
time: one that "leader run --strategy advisory" holds, or used within its
TTL, is refused (exit code 125, nothing run).

CMD's environment gets LEADER_NAME, LEADER_ID, LEADER_TERM and LEADER_HELD=1.
SIGINT or SIGTERM stops CMD (SIGTERM, SIGKILL after --grace); the lease is
kept for --window all the same.

Exit codes (as timeout(1), env(1) and "docker run": 125 to 127 are leader's):
  0        another host ran (or is running) this firing, or CMD exited 0
  N        CMD's exit code; 128+N if a signal N ended it
  125      "leader once" itself failed: a usage error (bad flags, no store;
           nothing was run), a store that refused it (the election is
           elected with the advisory strategy, tables never migrated, a
           wrong password: the message says what to do; nothing was run),
           or a runtime error (the store cannot be reached; or the lease
           was lost while CMD ran, and CMD was stopped)
  126      CMD was found but could not be executed
  127      CMD was not found
A CMD that itself exits with 125 to 127 cannot be told from these. In a
crontab, tell "the job failed" from "leader failed" by the code:
  leader once --name job -- ./job.sh; rc=$?; [ $rc -eq 125 ] && alert "leader failed"
`,
}

func init() {
	onceCommand.flags = func() *flag.FlagSet { return new(onceOptions).flags() }
	onceCommand.run = runOnceCommand
}

type onceOptions struct {
	commonOptions
	name     string
	id       string
	window   time.Duration
	grace    time.Duration
	strategy string
}

func (o *onceOptions) flags() *flag.FlagSet {
	fs := flag.NewFlagSet("once", flag.ContinueOnError)
	fs.Var((*requiredString)(&o.name), "name", "the election `NAME`: one per job")
	fs.StringVar(&o.id, "id", "", "this host's `ID`, shown by status while it runs")
	describeDefault(fs, "id", "<hostname>-<pid>")
	fs.DurationVar(&o.window, "window", defaultWindow, "how long the lease is held after a run starts and after it ends")
	fs.DurationVar(&o.grace, "grace", 0, "time between SIGTERM and SIGKILL when CMD must stop")
	describeDefault(fs, "grace", fmt.Sprintf("--window/5 minus a kill margin: %v for the default --window", defaultGrace(defaultWindow)))
	registerStrategy(fs, &o.strategy, "PostgreSQL strategy: lease only (advisory is refused: its lock would be freed when \"leader once\"\nexits, so the window after a run could not hold)")
	o.commonOptions.register(fs, "info")
	return fs
}

func runOnceCommand(a *app, ctx context.Context, args []string) int {
	ignoreJobControl()
	var o onceOptions
	fs := o.flags()
	argv, code, ok := a.parse(onceCommand, fs, args, true)
	if !ok {
		return code
	}
	graceSet := false
	fs.Visit(func(f *flag.Flag) { graceSet = graceSet || f.Name == "grace" })
	if !graceSet {
		o.grace = defaultGrace(o.window)
	}
	rawStore, storeErr := o.storeURL(a, fs)
	red := redact.ForURL(rawStore)
	fail := func(err error) int { return a.fail("once", red, err) }
	log, err := o.logger(a.stderr, red)
	if err != nil {
		return fail(err)
	}
	if o.name == "" {
		return fail(usagef("missing --name: the job's election name"))
	}
	if o.id == "" {
		host, _ := os.Hostname()
		o.id = host + "-" + strconv.Itoa(os.Getpid())
	}
	// The same rules as "leader run", with the window as the TTL.
	if err := validateConfig(leader.Config{Name: o.name, ID: o.id, TTL: o.window, StopGrace: o.grace + killMargin(o.window)}); err != nil {
		err = configUsageError(err, o.window, o.grace)
		var ue *usageError
		if errors.As(err, &ue) {
			ue.msg = strings.NewReplacer("--ttl", "--window").Replace(ue.msg)
		}
		return fail(err)
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
	if spec.strategy == strategyAdvisory {
		return fail(usagef("--strategy advisory does not suit \"leader once\": the lock would be freed when \"leader once\" exits, " +
			"so the window after a run, which keeps the other hosts' firings from running the job again, could not hold; " +
			"leave out --strategy to use the lease strategy"))
	}
	store, err := openStore(ctx, spec, log)
	if err != nil {
		return fail(err)
	}
	defer store.Close()
	// As in "leader run": say at every start which instances compete.
	log.Info("electing", slog.String("store", store.display), slog.String("scope", spec.scope()),
		slog.String("election", o.name), slog.String("id", o.id), slog.Duration("window", o.window))

	j := &onceJob{
		opts:      o,
		argv:      argv,
		store:     store,
		fencePath: store.fencePath(o.name),
		log:       log.With(slog.String("election", o.name)),
		stderr:    a.stderr,
	}
	return j.run(ctx, fail)
}

// onceJob is one invocation of "leader once".
type onceJob struct {
	opts      onceOptions
	argv      []string
	store     leader.Store
	fencePath string
	log       *slog.Logger
	stderr    io.Writer
}

// The lease timing of "leader once", as the Elector's with --window as the
// TTL: renewals every window/3, a drift margin of window/20, and a stop
// point that leaves --grace and the kill margin before the local deadline.
func (j *onceJob) renewEvery() time.Duration { return j.opts.window / 3 }

// stopAt is when the command must be told to stop for a grant or renewal
// sent at sent, unless a later renewal succeeds first.
func (j *onceJob) stopAt(sent time.Time) time.Time {
	w := j.opts.window
	return sent.Add(w - w/20 - j.opts.grace - killMargin(w))
}

// errTooLate reports a grant that came too late to run the command safely.
var errTooLate = errors.New("the store granted the lease too late to run the command safely before it could run out; released it")

func (j *onceJob) run(ctx context.Context, fail func(error) int) int {
	o := j.opts
	token, err := randomToken()
	if err != nil {
		return fail(err)
	}
	cand := leader.Candidate{ID: o.id, Token: token}
	lease, sent, granted, err := j.acquire(ctx, cand)
	if conflict := strategyConflict(err); conflict != nil {
		return fail(fmt.Errorf("%w; \"leader once\" always uses the lease strategy", conflict))
	}
	if err != nil {
		return fail(fmt.Errorf("taking the lease of %q: %w", o.name, err))
	}
	if !granted {
		j.log.Info("not running: this firing is taken", slog.String("leader", lease.HolderID),
			slog.Uint64("term", lease.Term), slog.Duration("remaining", lease.Remaining))
		return exitOK
	}
	term := lease.Term
	log := j.log.With(slog.Uint64("term", term))
	log.Info("running the command", slog.String("command", strings.Join(j.argv, " ")))

	fenceFile, err := fence.Acquire(ctx, j.fencePath, nil)
	if err != nil {
		j.keep(log, cand, term)
		return fail(err)
	}
	// The command's deadline is the stop point of the grant: the
	// supervisor stops it there unless a renewal has moved it on, even if
	// this process is frozen.
	deadline, err := supervise.DeadlineAt(j.stopAt(sent))
	if err != nil {
		_ = fence.Release(fenceFile)
		j.keep(log, cand, term)
		return fail(err)
	}
	child, err := supervise.Start(supervise.Options{
		Command:  j.argv,
		Env:      childEnv(os.Environ(), o.name, o.id, term),
		Grace:    o.grace,
		Fence:    fenceFile,
		Deadline: deadline,
	})
	if err != nil {
		_ = fence.Release(fenceFile)
		var se *supervise.StartError
		if errors.As(err, &se) && se.Result.DeadlinePassed {
			j.release(log, cand, term)
			return fail(errTooLate)
		}
		j.keep(log, cand, term)
		if errors.As(err, &se) {
			fmt.Fprintf(j.stderr, "leader once: %v\n", err)
			return commandExitCode(se.Result)
		}
		return fail(err)
	}
	fenceFile.Close() // the supervisor holds its own copy, and releases it

	res, lost := j.hold(ctx, log, child, cand, term, sent)
	if lost != nil {
		return fail(lost)
	}
	j.keep(log, cand, term)
	log.Info("command ended", slog.String("result", res.String()))
	return commandExitCode(res)
}

// acquire asks for the lease, timed from when the request was sent. The
// request is bounded by a renew interval and not cut short by ctx (a
// cancelled write may still commit, leaving a lease nobody uses). A grant
// that arrives after its stop point is released and reported as
// errTooLate; one that arrives after ctx ended is released too.
func (j *onceJob) acquire(ctx context.Context, cand leader.Candidate) (lease leader.Lease, sent time.Time, granted bool, err error) {
	sent = time.Now()
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), j.renewEvery())
	lease, granted, err = j.store.Acquire(actx, j.opts.name, cand, j.opts.window)
	cancel()
	if err != nil || !granted {
		return lease, sent, false, err
	}
	switch {
	case !time.Now().Before(j.stopAt(sent)):
		j.log.Warn("the lease was granted too late to run the command safely; releasing it",
			slog.Duration("took", time.Since(sent)))
		j.release(j.log, cand, lease.Term)
		return lease, sent, false, errTooLate
	case ctx.Err() != nil:
		j.release(j.log, cand, lease.Term)
		return lease, sent, false, ctx.Err()
	}
	return lease, sent, true, nil
}

// supervised is what hold needs of the running command: a
// *supervise.Child.
type supervised interface {
	Done() <-chan struct{}
	Result() supervise.Result
	Stop() supervise.Result
	Extend(supervise.Deadline)
}

// renewResult is the outcome of one renewal.
type renewResult struct {
	sent time.Time
	err  error
}

// hold renews the lease (granted at sent) while child runs. If renewals
// fail until the stop point, it stops child first and returns why. As in
// the Elector, renewals run on a goroutine of their own, bounded by the stop
// point, and the stop point is a timer of its own: a store call that
// outlives its context (pgx answers about a second after a deadline when
// the server does not) cannot delay the stop. After every renewal the
// command's deadline is moved on, so the supervisor stops the command by
// itself if this process is frozen.
func (j *onceJob) hold(ctx context.Context, log *slog.Logger, child supervised, cand leader.Candidate, term uint64, sent time.Time) (supervise.Result, error) {
	window := j.opts.window
	renewEvery := j.renewEvery()
	stopTimer := time.NewTimer(time.Until(j.stopAt(sent)))
	defer stopTimer.Stop()
	renewTimer := time.NewTimer(time.Until(sent.Add(renewEvery)))
	defer renewTimer.Stop()
	// Cancels a renewal still in flight when hold returns; it is left to
	// finish on its own goroutine (results is buffered).
	rpcs, cancelRPCs := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelRPCs()
	results := make(chan renewResult, 1)
	inflight := false
	interrupted := ctx.Done()
	lostContact := func() (supervise.Result, error) {
		log.Error("could not renew the lease; stopping the command before it could run out")
		res := child.Stop()
		return res, errors.New("lost contact with the store while the command ran; the command was stopped")
	}
	for {
		select {
		case <-child.Done():
			res := child.Result()
			if res.DeadlinePassed {
				return res, errors.New("the lease was not renewed before the command's deadline (the store was unreachable, or this process was frozen); the command was stopped")
			}
			return res, nil
		case <-interrupted:
			log.Info("interrupted: stopping the command")
			go child.Stop()
			interrupted = nil
		case <-stopTimer.C:
			return lostContact()
		case <-renewTimer.C:
			if inflight {
				continue
			}
			inflight = true
			go func(sent, stop time.Time) {
				rctx, cancel := context.WithDeadline(rpcs, stop)
				defer cancel()
				_, err := j.store.Renew(rctx, j.opts.name, cand.Token, term, window)
				results <- renewResult{sent: sent, err: err}
			}(time.Now(), j.stopAt(sent))
		case r := <-results:
			inflight = false
			switch {
			case r.err == nil:
				// Only a renewal that returned before the stop point
				// extends: once the timer has fired (Stop reports false),
				// the command must stop whatever the store says now.
				if !stopTimer.Stop() {
					return lostContact()
				}
				sent = r.sent
				stopTimer.Reset(time.Until(j.stopAt(sent)))
				if d, err := supervise.DeadlineAt(j.stopAt(sent)); err == nil {
					child.Extend(d)
				}
				renewTimer.Reset(time.Until(sent.Add(renewEvery)))
			case errors.Is(r.err, leader.ErrLeaseLost):
				log.Error("lease lost while the command ran; stopping it", slog.Any("error", r.err))
				child.Stop()
				return child.Result(), fmt.Errorf("the lease was lost while the command ran; the command was stopped: %w", r.err)
			default:
				log.Warn("renewing the lease failed; retrying", slog.Any("error", r.err),
					slog.Duration("left_before_stopping", time.Until(j.stopAt(sent))))
				renewTimer.Reset(max(renewEvery/4, 100*time.Millisecond))
			}
		}
	}
}

// keep renews the lease one last time for the whole window, so that firings
// arriving within the window after this run find it held.
func (j *onceJob) keep(log *slog.Logger, cand leader.Candidate, term uint64) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := j.store.Renew(ctx, j.opts.name, cand.Token, term, j.opts.window); err != nil {
		log.Warn("could not keep the lease for the window after the run", slog.Any("error", err))
	}
}

// release gives up a lease that was not used, best effort.
func (j *onceJob) release(log *slog.Logger, cand leader.Candidate, term uint64) {
	ctx, cancel := context.WithTimeout(context.Background(), j.renewEvery())
	defer cancel()
	if err := j.store.Release(ctx, j.opts.name, cand.Token, term); err != nil {
		log.Warn("could not release the lease; it will run out by itself", slog.Any("error", err))
	}
}

func randomToken() (string, error) {
	var b [16]byte
	if _, err := crand.Read(b[:]); err != nil {
		return "", err
	}
	return hex.EncodeToString(b[:]), nil
}
