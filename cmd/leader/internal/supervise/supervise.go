//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

// Package supervise runs a command so that it, and every process it starts in
// its process group, is gone when the leader command says so, and also when
// the leader command dies without saying anything (SIGKILL, OOM kill, a
// crash).
//
// # Design
//
// The leader process does not start the command itself. It re-executes its
// own binary as a small supervisor (the hidden subcommand Subcommand), with
// two pipes:
//
//	leader ──control pipe (fd 3)──> supervisor ──starts──> command (own process group)
//	leader <──status pipe (fd 4)─── supervisor
//
// The supervisor puts the command in a new process group and, on Linux,
// makes itself a child subreaper, so the command's orphaned children are
// reparented to it and can be waited for (elsewhere they go to init, which
// reaps them). It stops the whole group:
//
//   - on "stop" from the leader (or SIGTERM to the supervisor itself):
//     SIGTERM (and SIGCONT) to the group, SIGKILL to the group after the
//     grace period;
//   - on "kill", or when the control pipe reaches end-of-file because the
//     leader process died: SIGKILL to the group at once;
//   - when its deadline passes without the leader having extended it (a
//     dead-man's switch, see below): as on "stop";
//   - when the command exits on its own: whatever it left running in its
//     group is stopped as on "stop".
//
// The deadline covers a leader process that is alive but frozen (SIGSTOP,
// a cgroup freezer, a debugger, a paused VM): its control pipe stays open,
// so end-of-file never comes, yet its lease runs out and another instance
// takes over. The command is started with a deadline (Options.Deadline) and
// the leader moves it on after every successful renewal (Child.Extend). It
// is an absolute time on the host's CLOCK_MONOTONIC (see Deadline), so a
// frozen leader that computed an extension before freezing and writes it on
// resuming extends nothing.
//
// It then waits until no process of the group exists, reports the command's
// exit status on the status pipe, and exits. The control pipe's write end
// lives only in the leader process, so the kernel closes it when the leader
// dies, however it dies: end-of-file is a parent-death signal that, unlike
// PR_SET_PDEATHSIG, leaves the supervisor alive to clean up the group (a
// parent-death SIGKILL would kill the supervisor and orphan the group) and
// does not depend on which of the leader's threads forked it.
//
// Belt and braces: on Linux the command itself gets PR_SET_PDEATHSIG=SIGKILL
// tied to the supervisor (forked from a thread locked for the supervisor's
// lifetime), so if the supervisor is killed the command dies too; and, on
// every platform, the leader process, seeing the status pipe close without a
// result, SIGKILLs the group itself.
//
// # Platforms
//
// The package builds on Unix systems. The pipe protocol, the process groups
// and the fence are the same everywhere; Linux adds the child subreaper, the
// parent-death signal and /proc/self/exe (SelfExecutable), which other
// systems do without: see the Linux and non-Linux versions of
// becomeSubreaper, commandAttr and SelfExecutable. Without the parent-death
// signal, a command whose supervisor and leader process are both killed at
// once (for example "killall -9 leader") keeps running.
//
// The supervisor is in a process group of its own as well, so a terminal's
// Ctrl-C or a "kill -9 -PGID" aimed at the leader's job does not reach it:
// the leader decides how the command is stopped.
//
// Optionally the supervisor holds a fence (a file locked with flock) until
// the group is gone, then releases it; see package fence. A process that leaves the group (for
// example by calling setsid to daemonize) escapes supervision.
package supervise

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Subcommand is the hidden subcommand of the leader binary that runs the
// supervisor; the leader command's main dispatches it to Main.
const Subcommand = "__supervise"

// File descriptors the supervisor receives.
const (
	fdControl = 3
	fdStatus  = 4
	fdFence   = 5
)

// Messages on the control pipe, one per line.
const (
	msgStop  = "stop"
	msgKill  = "kill"
	msgUntil = "until" // "until N": the deadline is now N (see Deadline)
)

// Options says what to run and how.
type Options struct {
	// Executable is the leader binary to re-execute as the supervisor.
	// Default: SelfExecutable().
	Executable string
	// Command is the program and its arguments. Required.
	Command []string
	// Env is the command's environment. Default: os.Environ().
	Env []string
	// Grace is how long the group has between SIGTERM and SIGKILL on Stop.
	Grace time.Duration
	// Deadline is when the supervisor stops the command (as on Stop) unless
	// Extend has moved it on by then. Required: a command never runs
	// without one. If it has passed when the supervisor is about to start
	// the command, the command is not started and Start returns a
	// StartError whose Result has DeadlinePassed set.
	Deadline Deadline
	// Fence, if not nil, is a fence from fence.Acquire, passed to the
	// supervisor, which keeps it open until the command's process group is
	// gone and then ends the hold (fence.Release, which removes the file).
	// Once Start returns, the caller closes its own copy: with Close if
	// Start succeeded, with fence.Release if not.
	Fence *os.File
	// Stdout and Stderr receive the command's output. Default: the leader's.
	// The command's standard input is /dev/null: it runs in a background
	// process group, where reading a terminal would stop it.
	Stdout, Stderr *os.File
}

// Result is how a command ended.
type Result struct {
	// ExitCode is the command's exit code, or -1 if a signal ended it.
	ExitCode int
	// Signal is the signal that ended the command, or 0.
	Signal syscall.Signal
	// Err is set if the command could not be started (ExitCode is then 127
	// for a command not found and 126 for one that cannot be executed, as in
	// a shell) or if supervision failed.
	Err error
	// DeadlinePassed reports that the supervisor stopped the command, or
	// did not start it, because its deadline passed without being
	// extended: the command did not end on its own.
	DeadlinePassed bool
}

// Code is the result as one exit code, shell style: the exit code, or 128+N
// for a command ended by signal N.
func (r Result) Code() int {
	if r.Signal != 0 {
		return 128 + int(r.Signal)
	}
	return r.ExitCode
}

// Success reports whether the command exited with code 0.
func (r Result) Success() bool { return r.Err == nil && r.Signal == 0 && r.ExitCode == 0 }

func (r Result) String() string {
	switch {
	case r.Err != nil:
		return fmt.Sprintf("failed: %v (exit code %d)", r.Err, r.ExitCode)
	case r.Signal != 0 && r.DeadlinePassed:
		return fmt.Sprintf("killed by signal %d (%v; exit code %d) after its deadline passed", int(r.Signal), r.Signal, r.Code())
	case r.Signal != 0:
		return fmt.Sprintf("killed by signal %d (%v; exit code %d)", int(r.Signal), r.Signal, r.Code())
	case r.DeadlinePassed:
		return fmt.Sprintf("exited with code %d after its deadline passed", r.ExitCode)
	default:
		return fmt.Sprintf("exited with code %d", r.ExitCode)
	}
}

// Child is a command running under a supervisor.
type Child struct {
	pid      int
	sup      *exec.Cmd
	control  *os.File
	done     chan struct{}
	result   Result
	sendOnce sync.Mutex
	sent     string
}

// Start starts the supervisor and, through it, the command. It returns once
// the command has been started, with its pid, or with an error if the command
// could not be started (the error's Result is in StartError).
func Start(opts Options) (*Child, error) {
	if len(opts.Command) == 0 {
		return nil, errors.New("supervise: no command")
	}
	if opts.Deadline <= 0 {
		return nil, errors.New("supervise: no deadline")
	}
	exe := opts.Executable
	if exe == "" {
		var err error
		if exe, err = SelfExecutable(); err != nil {
			return nil, fmt.Errorf("supervise: finding the leader executable: %w", err)
		}
	}
	ctlR, ctlW, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("supervise: %w", err)
	}
	stR, stW, err := os.Pipe()
	if err != nil {
		ctlR.Close()
		ctlW.Close()
		return nil, fmt.Errorf("supervise: %w", err)
	}
	args := []string{Subcommand, "--grace", opts.Grace.String(), "--until", strconv.FormatInt(int64(opts.Deadline), 10)}
	extra := []*os.File{ctlR, stW}
	if opts.Fence != nil {
		args = append(args, "--fence", opts.Fence.Name())
		extra = append(extra, opts.Fence)
	}
	args = append(args, "--")
	args = append(args, opts.Command...)
	cmd := exec.Command(exe, args...)
	cmd.Env = opts.Env
	if cmd.Env == nil {
		cmd.Env = os.Environ()
	}
	cmd.Stdout = orDefault(opts.Stdout, os.Stdout)
	cmd.Stderr = orDefault(opts.Stderr, os.Stderr)
	cmd.ExtraFiles = extra
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	err = cmd.Start()
	ctlR.Close()
	stW.Close()
	if err != nil {
		ctlW.Close()
		stR.Close()
		return nil, fmt.Errorf("supervise: starting the supervisor: %w", err)
	}
	c := &Child{sup: cmd, control: ctlW, done: make(chan struct{})}
	status := bufio.NewReader(stR)
	first, readErr := readLine(status)
	if kind, rest, _ := strings.Cut(first, " "); kind == "pid" {
		c.pid, _ = strconv.Atoi(rest)
	}
	if c.pid <= 0 {
		// The command did not start: the supervisor says why and exits.
		res := parseResult(first, readErr)
		_, _ = io.Copy(io.Discard, status)
		stR.Close()
		ctlW.Close()
		_ = cmd.Wait()
		return nil, &StartError{Result: res}
	}
	go c.watch(status, stR)
	return c, nil
}

// ErrDeadlinePassed is the Err of a Result whose command was not started
// because its deadline had passed.
var ErrDeadlinePassed = errors.New("the deadline passed before the command could start")

// Words of the supervisor's report about the deadline.
const (
	reportDeadline = "deadline" // after "exit N" or "signal N"
	reportLate     = "late"     // instead of "pid N"
)

// StartError is returned by Start when the command could not be started.
type StartError struct{ Result Result }

func (e *StartError) Error() string { return e.Result.Err.Error() }
func (e *StartError) Unwrap() error { return e.Result.Err }

func orDefault(f, def *os.File) *os.File {
	if f != nil {
		return f
	}
	return def
}

func readLine(r *bufio.Reader) (string, error) {
	line, err := r.ReadString('\n')
	return strings.TrimSuffix(line, "\n"), err
}

// watch reads the supervisor's final report and waits for it to exit.
func (c *Child) watch(status *bufio.Reader, f *os.File) {
	line, err := readLine(status)
	f.Close()
	c.result = parseResult(line, err)
	_ = c.sup.Wait()
	c.control.Close()
	if c.result.Err != nil {
		// The supervisor died without reporting (someone killed it): make
		// sure the group is gone all the same.
		killGroupAndWait(c.pid, 5*time.Second)
	}
	close(c.done)
}

// parseResult decodes the supervisor's report: "exit N", "signal N" (each
// followed by " deadline" if the deadline passed), "late" (the deadline had
// passed before the command could start) or "error N message".
func parseResult(line string, readErr error) Result {
	kind, rest, _ := strings.Cut(line, " ")
	rest, late := strings.CutSuffix(rest, " "+reportDeadline)
	switch kind {
	case "exit":
		n, err := strconv.Atoi(rest)
		if err == nil {
			return Result{ExitCode: n, DeadlinePassed: late}
		}
	case "signal":
		n, err := strconv.Atoi(rest)
		if err == nil {
			return Result{ExitCode: -1, Signal: syscall.Signal(n), DeadlinePassed: late}
		}
	case reportLate:
		return Result{ExitCode: 1, Err: ErrDeadlinePassed, DeadlinePassed: true}
	case "error":
		code, msg, _ := strings.Cut(rest, " ")
		n, err := strconv.Atoi(code)
		if err == nil {
			return Result{ExitCode: n, Err: errors.New(msg)}
		}
	}
	if readErr == nil {
		readErr = fmt.Errorf("unexpected report %q", line)
	}
	return Result{ExitCode: 1, Err: fmt.Errorf("supervisor ended without reporting the command's exit: %v", readErr)}
}

// killGroupAndWait SIGKILLs process group pgid and waits, up to limit, until
// it has no members.
func killGroupAndWait(pgid int, limit time.Duration) {
	if pgid <= 0 {
		return
	}
	_ = syscall.Kill(-pgid, syscall.SIGKILL)
	deadline := time.Now().Add(limit)
	for groupAlive(pgid) && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
}

// Pid returns the command's process ID, which is also its process group ID.
func (c *Child) Pid() int { return c.pid }

// Done is closed when the command and its whole process group are gone.
func (c *Child) Done() <-chan struct{} { return c.done }

// Result returns how the command ended; call it after Done is closed.
func (c *Child) Result() Result {
	<-c.done
	return c.result
}

// Stop asks the supervisor to stop the command's group (SIGTERM, then
// SIGKILL after the grace period) and waits until it is gone.
func (c *Child) Stop() Result {
	c.send(msgStop)
	return c.Result()
}

// Kill asks the supervisor to SIGKILL the command's group at once and waits
// until it is gone.
func (c *Child) Kill() Result {
	c.send(msgKill)
	return c.Result()
}

// Extend moves the command's deadline on to d: the supervisor stops the
// command (as on Stop) when d passes unless Extend is called again first. A
// d earlier than the current deadline changes nothing. It does nothing once
// Stop or Kill has been called.
func (c *Child) Extend(d Deadline) {
	c.sendOnce.Lock()
	defer c.sendOnce.Unlock()
	if c.sent != "" {
		return
	}
	select {
	case <-c.done:
		return
	default:
	}
	_, _ = c.control.WriteString(msgUntil + " " + strconv.FormatInt(int64(d), 10) + "\n")
}

func (c *Child) send(msg string) {
	c.sendOnce.Lock()
	defer c.sendOnce.Unlock()
	if c.sent == msgKill || c.sent == msg {
		return
	}
	select {
	case <-c.done:
		return
	default:
	}
	c.sent = msg
	// An error means the supervisor is already gone; Done reports it.
	_, _ = c.control.WriteString(msg + "\n")
}
