// Package childproc runs the fault suites' child processes: the test
// binary started again to run one test, which the parent kills, pauses
// and resumes, taking a CLOCK_MONOTONIC reading at each, so that what the
// child believed can be judged against when it could run. Both fault
// suites (faults, on PostgreSQL, and etcd/faults) use it.
package childproc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/leaderelect/leader/internal/monotime"
)

// Process is a running child process.
type Process struct {
	id      string
	logPath string
	cmd     *exec.Cmd
	stdin   io.Closer // closing it asks the child to stop
	killed  bool
	exited  chan struct{} // closed once Wait has returned
	err     error         // Wait's, once exited is closed
}

// Start starts the test binary again as the child id, running the test
// that test names alone, with env as its environment and its standard
// output and error in the file logPath. The child runs in a process group
// of its own: if the test binary dies while the child is stopped, the
// group is orphaned and the kernel sends it SIGHUP then SIGCONT, and
// SIGHUP ends it. A child that runs should end when its standard input
// closes (see StopAll). It is killed when the test ends, if it still
// runs then.
func Start(t testing.TB, id, test, logPath string, env []string) *Process {
	t.Helper()
	p := &Process{id: id, logPath: logPath, exited: make(chan struct{})}
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close() // the child has its own copy
	p.cmd = exec.Command(os.Args[0], "-test.run=^"+test+"$", "-test.count=1", "-test.timeout=0")
	p.cmd.Env = env
	p.cmd.Stdout, p.cmd.Stderr = logf, logf
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if p.stdin, err = p.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("%s: starting the child process: %v", id, err)
	}
	go func() {
		p.err = p.cmd.Wait()
		close(p.exited)
	}()
	t.Cleanup(func() { _, _ = p.Kill() })
	return p
}

// Env returns the test's environment less the variables named drop: those
// that would make a child do more than the parent asks (a soak mode, say),
// or that the parent sets for each child.
func Env(drop ...string) []string {
	var env []string
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		if !slices.Contains(drop, name) {
			env = append(env, kv)
		}
	}
	return env
}

// ID returns the child's ID, as given to Start.
func (p *Process) ID() string { return p.id }

// LogPath returns the file of the child's standard output and error.
func (p *Process) LogPath() string { return p.logPath }

// Killed reports whether Kill was called.
func (p *Process) Killed() bool { return p.killed }

// Exited is closed once the child has exited.
func (p *Process) Exited() <-chan struct{} { return p.exited }

// Err returns how the child exited (exec.Cmd.Wait's error); call it
// once Exited is closed.
func (p *Process) Err() error { return p.err }

// Kill kills the child with SIGKILL, takes a CLOCK_MONOTONIC reading as
// soon as kill(2) has returned, waits for the child to exit and returns
// the reading: the process can believe nothing after it. Killing a child
// that has already exited does nothing but return an error saying so.
func (p *Process) Kill() (killedAt int64, err error) {
	select {
	case <-p.exited:
		return 0, fmt.Errorf("%s had already exited (%v)", p.id, p.err)
	default:
	}
	if err := p.cmd.Process.Signal(syscall.SIGKILL); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return 0, fmt.Errorf("%s: SIGKILL: %w", p.id, err)
	}
	killedAt, err = monotime.Now()
	p.killed = true
	<-p.exited
	return killedAt, err
}

// Pause stops the child with SIGSTOP, waits until the kernel reports it
// stopped (every thread of it), and returns a CLOCK_MONOTONIC reading
// taken then, which it also writes to the child's pause file in dir (the
// directory it shares with the child) for the child to read when it
// resumes (ReadPause).
func (p *Process) Pause(t testing.TB, dir string) (pausedAt int64) {
	t.Helper()
	if err := p.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatalf("%s: SIGSTOP: %v", p.id, err)
	}
	pid := p.cmd.Process.Pid
	const within = 10 * time.Second
	deadline := time.Now().Add(within)
	for {
		// WUNTRACED reports the stop (once); Wait, in its own
		// goroutine, waits only for the exit.
		var ws syscall.WaitStatus
		got, err := syscall.Wait4(pid, &ws, syscall.WUNTRACED|syscall.WNOHANG, nil)
		if err != nil {
			t.Fatalf("%s: waiting for it to stop: %v", p.id, err)
		}
		if got == pid && ws.Stopped() {
			break
		}
		if got == pid {
			t.Fatalf("%s: ended (%v) instead of stopping", p.id, ws)
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not stopped %v after SIGSTOP", p.id, within)
		}
		time.Sleep(time.Millisecond) // poll interval
	}
	pausedAt = Now(t)
	if err := os.WriteFile(pauseFile(dir, p.id), []byte(strconv.FormatInt(pausedAt, 10)), 0o644); err != nil {
		t.Fatal(err)
	}
	return pausedAt
}

// Resume sends the child SIGCONT and returns a CLOCK_MONOTONIC reading
// taken just before: the child ran not at all between its pause and then.
func (p *Process) Resume(t testing.TB) (resumedAt int64) {
	t.Helper()
	resumedAt = Now(t)
	if err := p.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatalf("%s: SIGCONT: %v", p.id, err)
	}
	return resumedAt
}

// StopAll asks every child of procs that was not killed to stop, all at
// once, by closing their standard input, and fails the test unless each
// exits within the given time, and its test passed (exit status 0).
// One that does not exit in time is killed.
func StopAll(t testing.TB, procs []*Process, within time.Duration) {
	t.Helper()
	var live []*Process
	for _, p := range procs {
		if !p.killed {
			_ = p.stdin.Close()
			live = append(live, p)
		}
	}
	timeout := time.NewTimer(within)
	defer timeout.Stop()
	for _, p := range live {
		select {
		case <-p.exited:
			if p.err != nil {
				t.Errorf("%s exited with %v after its standard input closed; see its log", p.id, p.err)
			}
		case <-timeout.C:
			_, _ = p.Kill()
			t.Errorf("%s did not exit within %v of its standard input closing; killed", p.id, within)
		}
	}
}

// DumpLogs shows the last 40 lines of every child's log if the test
// failed.
func DumpLogs(t testing.TB, procs []*Process) {
	if !t.Failed() {
		return
	}
	for _, p := range procs {
		b, _ := os.ReadFile(p.logPath)
		lines := strings.Split(strings.TrimSpace(string(b)), "\n")
		t.Logf("log of %s (exit: %v), last lines:\n%s", p.id, p.err, strings.Join(lines[max(0, len(lines)-40):], "\n"))
	}
}

// Now returns a CLOCK_MONOTONIC reading, failing the test if it cannot.
func Now(t testing.TB) int64 {
	t.Helper()
	at, err := monotime.Now()
	if err != nil {
		t.Fatal(err)
	}
	return at
}

// Child is a child process's side: it returns a context that ends when
// the child's standard input closes (the parent asks it to stop, or
// died), and a channel that receives SIGCONT, registered before Child
// returns, so that no resumption after it goes unnoticed. stop releases
// both.
func Child() (ctx context.Context, resumed <-chan os.Signal, stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		cancel()
	}()
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGCONT)
	return ctx, ch, func() {
		signal.Stop(ch)
		cancel()
	}
}

// pauseFile is the file in dir in which Pause writes, while the child id
// is stopped, the CLOCK_MONOTONIC reading taken during the pause.
func pauseFile(dir, id string) string {
	return filepath.Join(dir, id+".paused")
}

// ReadPause returns, in the child id, the CLOCK_MONOTONIC reading that
// Pause wrote to its pause file in dir during its latest pause, or an
// error wrapping os.ErrNotExist if it was never paused.
func ReadPause(dir, id string) (int64, error) {
	b, err := os.ReadFile(pauseFile(dir, id))
	if err != nil {
		return 0, err
	}
	pausedAt, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("pause file %q: %w", b, err)
	}
	return pausedAt, nil
}
