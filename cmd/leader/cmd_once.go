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
	name:     "once",
	synopsis: "leader once --name NAME [--window D] [flags] -- CMD [ARGS...]",
	summary:  "run a command on one host per firing (for crontabs installed on every host)",
	help: `
For a crontab installed on every host: at most one host runs CMD for each
firing, even when the hosts' cron daemons and clocks fire up to a minute
apart; on the others "leader once" exits 0 without a word.

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
"leader once" exits 1.

On the embedded store (one host), runs never overlap either; but the kernel
frees the lock when "leader once" exits, normally or not, so the window after
a run does not hold there: a later invocation runs again.

CMD's environment gets LEADER_NAME, LEADER_ID, LEADER_TERM and LEADER_HELD=1.
SIGINT or SIGTERM stops CMD (SIGTERM, SIGKILL after --grace); the lease is
kept for --window all the same.

Exit codes:
  0        another host ran (or is running) this firing, or CMD exited 0
  N        CMD's exit code; 128+N if a signal N ended it; 126/127 if it
           could not be executed / was not found
  1        runtime error: the store cannot be reached, or the lease was lost
           while CMD ran (CMD was stopped)
  2        usage error; nothing was run
`,
}

func init() {
	onceCommand.flags = func() *flag.FlagSet { return new(onceOptions).flags() }
	onceCommand.run = runOnceCommand
}

type onceOptions struct {
	commonOptions
	name   string
	id     string
	window time.Duration
	grace  time.Duration
}

func (o *onceOptions) flags() *flag.FlagSet {
	fs := flag.NewFlagSet("once", flag.ContinueOnError)
	fs.StringVar(&o.name, "name", "", "the election `NAME`: one per job (required)")
	fs.StringVar(&o.id, "id", "", "this host's `ID`, shown by status while it runs (default <hostname>-<pid>)")
	fs.DurationVar(&o.window, "window", defaultWindow, "how long the lease is held after a run starts and after it ends")
	fs.DurationVar(&o.grace, "grace", 0, "time between SIGTERM and SIGKILL when CMD must stop (default --window/5 minus a kill margin)")
	o.commonOptions.register(fs, "warn")
	return fs
}

func runOnceCommand(a *app, ctx context.Context, args []string) int {
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
	rawStore := o.storeURL(a)
	red := redact.ForURL(rawStore)
	fail := func(err error) int { return a.fail("once", red, err) }
	log, err := o.logger(a.stderr, red)
	if err != nil {
		return fail(err)
	}
	if o.name == "" {
		return fail(usagef("missing --name: the job's election name"))
	}
	if o.grace < 0 {
		return fail(usagef("--grace %v: must not be negative", o.grace))
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
	spec, err := parseStoreURL(rawStore)
	if err != nil {
		return fail(err)
	}
	store, err := openStore(ctx, spec, log)
	if err != nil {
		return fail(err)
	}
	defer store.Close()

	j := &onceJob{opts: o, argv: argv, store: store, log: log.With(slog.String("election", o.name)), stderr: a.stderr}
	return j.run(ctx, fail)
}

// onceJob is one invocation of "leader once".
type onceJob struct {
	opts   onceOptions
	argv   []string
	store  *openedStore
	log    *slog.Logger
	stderr io.Writer
}

func (j *onceJob) run(ctx context.Context, fail func(error) int) int {
	o := j.opts
	token, err := randomToken()
	if err != nil {
		return fail(err)
	}
	cand := leader.Candidate{ID: o.id, Token: token}
	sent := time.Now()
	lease, granted, err := j.store.Acquire(ctx, o.name, cand, o.window)
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

	fencePath := fence.Path(fence.Dir(), j.store.id, o.name)
	fenceFile, err := fence.Acquire(ctx, fencePath, nil)
	if err != nil {
		j.keep(log, cand, term)
		return fail(err)
	}
	child, err := supervise.Start(supervise.Options{
		Command: j.argv,
		Env:     childEnv(os.Environ(), o.name, o.id, term),
		Grace:   o.grace,
		Fence:   fenceFile,
	})
	fenceFile.Close()
	if err != nil {
		j.keep(log, cand, term)
		var se *supervise.StartError
		if errors.As(err, &se) {
			fmt.Fprintf(j.stderr, "leader once: %v\n", err)
			return se.Result.ExitCode
		}
		return fail(err)
	}

	res, lost := j.hold(ctx, log, child, cand, term, sent)
	if lost != nil {
		return fail(lost)
	}
	j.keep(log, cand, term)
	log.Info("command ended", slog.String("result", res.String()))
	return res.Code()
}

// hold renews the lease while child runs. If renewals fail until the lease
// could run out, it stops child first and returns why.
func (j *onceJob) hold(ctx context.Context, log *slog.Logger, child *supervise.Child, cand leader.Candidate, term uint64, sent time.Time) (supervise.Result, error) {
	window := j.opts.window
	renewEvery := window / 3
	drift := window / 20
	stopAt := func(sent time.Time) time.Time {
		return sent.Add(window - drift - j.opts.grace - killMargin(window))
	}
	stopTimer := time.NewTimer(time.Until(stopAt(sent)))
	defer stopTimer.Stop()
	renewTimer := time.NewTimer(renewEvery)
	defer renewTimer.Stop()
	interrupted := ctx.Done()
	for {
		select {
		case <-child.Done():
			return child.Result(), nil
		case <-interrupted:
			log.Info("interrupted: stopping the command")
			go child.Stop()
			interrupted = nil
		case <-stopTimer.C:
			log.Error("could not renew the lease; stopping the command before it could run out")
			child.Stop()
			return child.Result(), errors.New("lost contact with the store while the command ran; the command was stopped")
		case <-renewTimer.C:
			s := time.Now()
			rctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), stopAt(sent))
			_, err := j.store.Renew(rctx, j.opts.name, cand.Token, term, window)
			cancel()
			switch {
			case err == nil:
				sent = s
				stopTimer.Reset(time.Until(stopAt(sent)))
				renewTimer.Reset(renewEvery)
			case errors.Is(err, leader.ErrLeaseLost):
				log.Error("lease lost while the command ran; stopping it", slog.Any("error", err))
				child.Stop()
				return child.Result(), fmt.Errorf("the lease was lost while the command ran; the command was stopped: %w", err)
			default:
				log.Warn("renewing the lease failed; retrying", slog.Any("error", err))
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

func randomToken() (string, error) {
	var b [16]byte
	if _, err := crand.Read(b[:]); err != nil {
		return "", err
	}
	return hex.EncodeToString(b[:]), nil
}
