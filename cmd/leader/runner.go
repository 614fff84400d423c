//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/cmd/leader/internal/fence"
	"github.com/leaderelect/leader/cmd/leader/internal/supervise"
)

// Restart policies (--restart): what "leader run" does when the command
// exits on its own while this instance leads.
const (
	restartNever     = "never"      // release the lease and exit with the command's exit code
	restartOnFailure = "on-failure" // start it again after a nonzero exit; exit 0 after a zero exit
	restartAlways    = "always"     // start it again, whatever its exit code
)

// Backoff between restarts: it starts at restartBackoffMin, doubles after
// each quick exit up to restartBackoffMax, and starts over after a run that
// lasted restartBackoffReset.
const (
	restartBackoffMin   = 200 * time.Millisecond
	restartBackoffMax   = 10 * time.Second
	restartBackoffReset = 10 * time.Second
)

// commandRunner runs the command while this instance leads. Its onElected and
// onDemoted are the Elector's callbacks: onElected starts the command (again
// after each exit, as the restart policy says) and onDemoted stops it and
// returns only once the command's whole process group is gone, so the lease
// is released, or runs out, only after that.
type commandRunner struct {
	argv      []string
	name, id  string
	grace     time.Duration
	restart   string
	fencePath string
	// stopAt returns the Elector's Status().StopAt: while leading, when
	// this instance stops leading unless a renewal succeeds; zero when not
	// leading. It is the command's deadline (see supervise.Deadline).
	stopAt func() time.Time
	// poll is how often the deadline is checked for extensions: a quarter
	// of the renew interval.
	poll time.Duration
	log  *slog.Logger
	// finish is called when the command exited and the policy says to stop
	// "leader run" with the given exit code.
	finish func(code int)

	mu       sync.Mutex
	child    *supervise.Child // the command while it runs
	stopping *supervise.Child // the command being stopped, once logged
	forced   bool             // stop by SIGKILL at once (a second SIGINT/SIGTERM)
}

// onElected runs the command until ctx (the leader context) ends or the
// restart policy says to stop.
func (r *commandRunner) onElected(ctx context.Context) {
	term, _ := leader.TermFrom(ctx)
	log := r.log.With(slog.Uint64("term", term))
	backoff := restartBackoffMin
	for {
		started := time.Now()
		res, ok := r.runOnce(ctx, log, term)
		if !ok {
			return // leadership lost; onDemoted stopped the command
		}
		switch {
		case res.DeadlinePassed:
			// Stopped (or not started) by the supervisor's dead-man's
			// switch, not ended by the command: this process was frozen
			// or its renewals came late. Leadership is over or about to
			// be; if a renewal did succeed just in time, start it again.
			log.Warn("the command's deadline passed before this process extended it (was it frozen?)",
				slog.String("result", res.String()))
			backoff = restartBackoffMin
		case r.restart == restartNever:
			r.finish(commandExitCode(res))
			return
		case r.restart == restartOnFailure && res.Success():
			r.finish(exitOK)
			return
		}
		if time.Since(started) >= restartBackoffReset {
			backoff = restartBackoffMin
		}
		log.Info("restarting the command", slog.String("restart", r.restart), slog.Duration("after", backoff))
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		backoff = min(2*backoff, restartBackoffMax)
	}
}

// runOnce starts the command and waits for it. ok is false if leadership
// was lost first (the command has then been stopped).
func (r *commandRunner) runOnce(ctx context.Context, log *slog.Logger, term uint64) (supervise.Result, bool) {
	// The fence makes sure the previous leader's command on this host is
	// gone (see package fence).
	fenceFile, err := fence.Acquire(ctx, r.fencePath, func() {
		log.Info("waiting for the previous command of this election on this host to end")
	})
	if err != nil {
		return supervise.Result{}, false
	}
	// Until the supervisor has it, the hold ends here (see fence.Release).
	handedOver := false
	defer func() {
		if !handedOver {
			_ = fence.Release(fenceFile)
		}
	}()

	// The command never runs without a deadline: the moment this instance
	// stops leading unless a renewal succeeds first. Past that moment
	// leadership is over, and the leader context is about to end.
	stopAt := r.stopAt()
	if stopAt.IsZero() || !time.Now().Before(stopAt) {
		<-ctx.Done()
		return supervise.Result{}, false
	}
	deadline, err := supervise.DeadlineAt(stopAt)
	if err != nil {
		log.Error("cannot start the command", slog.Any("error", err))
		return supervise.Result{ExitCode: exitLeaderError, Err: err}, true
	}

	r.mu.Lock()
	if ctx.Err() != nil {
		r.mu.Unlock()
		return supervise.Result{}, false
	}
	child, err := supervise.Start(supervise.Options{
		Command:  r.argv,
		Env:      childEnv(os.Environ(), r.name, r.id, term),
		Grace:    r.grace,
		Fence:    fenceFile,
		Deadline: deadline,
	})
	if err == nil {
		r.child = child
		// The supervisor holds its own copy now, and releases it.
		fenceFile.Close()
		handedOver = true
	}
	r.mu.Unlock()

	if err != nil {
		var se *supervise.StartError
		if errors.As(err, &se) && se.Result.DeadlinePassed {
			return se.Result, ctx.Err() == nil
		}
		if errors.As(err, &se) {
			log.Error("cannot start the command", slog.Any("error", err), slog.Int("exit_code", commandExitCode(se.Result)))
			return se.Result, true
		}
		log.Error("cannot start the command", slog.Any("error", err))
		return supervise.Result{ExitCode: exitLeaderError, Err: err}, true
	}
	log.Info("command started", slog.Int("pid", child.Pid()), slog.String("command", strings.Join(r.argv, " ")))
	extending := make(chan struct{})
	defer func() { <-extending }()
	go func() {
		defer close(extending)
		r.extend(ctx, child, stopAt)
	}()

	select {
	case <-child.Done():
	case <-ctx.Done():
		// Leadership lost: the Elector calls onDemoted, which stops the
		// command too; whichever comes first logs it.
		r.stop(child, "leadership lost")
		return supervise.Result{}, false
	}
	r.clear(child)
	res := child.Result()
	if res.DeadlinePassed {
		return res, ctx.Err() == nil
	}
	level := slog.LevelInfo
	if !res.Success() {
		level = slog.LevelWarn
	}
	log.Log(context.Background(), level, "command ended on its own", slog.String("result", res.String()),
		slog.Int("exit_code", commandExitCode(res)))
	return res, true
}

// extend is the leader's half of the dead-man's switch: while child runs
// and this instance leads, it moves the command's deadline on to the
// Elector's stop point each time a renewal has moved that (sent is the stop
// point the command was started with). If this process is frozen, nothing
// moves the deadline on, and the supervisor stops the command when it
// passes. It checks every r.poll, and more often as the deadline nears, so
// that a renewal that succeeds close to the stop point reaches the
// supervisor in time.
func (r *commandRunner) extend(ctx context.Context, child *supervise.Child, sent time.Time) {
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-child.Done():
			return
		case <-t.C:
		}
		at := r.stopAt()
		if at.IsZero() {
			return // no longer leading: onDemoted stops the command
		}
		if at.After(sent) {
			d, err := supervise.DeadlineAt(at)
			if err != nil {
				r.log.Error("cannot extend the command's deadline", slog.Any("error", err))
			} else {
				child.Extend(d)
				sent = at
			}
		}
		t.Reset(min(r.poll, max(time.Until(sent)/4, 5*time.Millisecond)))
	}
}

func (r *commandRunner) clear(c *supervise.Child) {
	r.mu.Lock()
	if r.child == c {
		r.child = nil
	}
	r.mu.Unlock()
}

// stop stops c, gracefully unless forced, and waits until its group is
// gone. It may be called more than once for one child; the first call logs.
func (r *commandRunner) stop(c *supervise.Child, why string) supervise.Result {
	r.mu.Lock()
	forced := r.forced
	first := r.stopping != c
	r.stopping = c
	r.mu.Unlock()
	if first {
		r.log.Info(why+": stopping the command", slog.Int("pid", c.Pid()), slog.Duration("grace", r.grace),
			slog.Bool("kill", forced))
	}
	began := time.Now()
	var res supervise.Result
	if forced {
		res = c.Kill()
	} else {
		res = c.Stop()
	}
	if first {
		r.log.Info("command stopped", slog.Int("pid", c.Pid()), slog.String("result", res.String()),
			slog.Duration("took", time.Since(began).Round(time.Millisecond)))
	}
	return res
}

// onDemoted stops the command, if it runs, and returns when it is gone. The
// leader context is already cancelled, so no new command starts after this.
func (r *commandRunner) onDemoted() {
	r.mu.Lock()
	c := r.child
	r.mu.Unlock()
	if c != nil {
		r.stop(c, "leadership lost")
	}
}

// kill makes every later stop a SIGKILL, and kills the running command now.
func (r *commandRunner) kill() {
	r.mu.Lock()
	r.forced = true
	c := r.child
	r.mu.Unlock()
	if c != nil {
		go c.Kill()
	}
}

// commandExitCode is the exit code "leader run" and "leader once" report for
// a command that ended (or could not start) with res: the command's own, or
// 128+N if signal N ended it; exitNotFound or exitCannotExecute if it could
// not be started; exitLeaderError if leader itself failed to start or
// supervise it (the supervisor could not run, or died without reporting).
func commandExitCode(res supervise.Result) int {
	if res.Err != nil && res.ExitCode != exitNotFound && res.ExitCode != exitCannotExecute {
		return exitLeaderError
	}
	return res.Code()
}

// childEnv returns base with the LEADER_* variables set for the command.
func childEnv(base []string, name, id string, term uint64) []string {
	set := map[string]string{
		"LEADER_NAME": name,
		"LEADER_ID":   id,
		"LEADER_TERM": strconv.FormatUint(term, 10),
		"LEADER_HELD": "1",
	}
	env := make([]string, 0, len(base)+len(set))
	for _, kv := range base {
		k, _, _ := strings.Cut(kv, "=")
		if _, ours := set[k]; !ours {
			env = append(env, kv)
		}
	}
	for _, k := range []string{"LEADER_NAME", "LEADER_ID", "LEADER_TERM", "LEADER_HELD"} {
		env = append(env, k+"="+set[k])
	}
	return env
}
