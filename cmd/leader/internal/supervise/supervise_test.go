//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package supervise

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// The test binary doubles as the leader binary: run as the supervisor, or as
// a stand-in leader process that the tests kill.
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == Subcommand {
		os.Exit(Main(os.Args[2:]))
	}
	if os.Getenv("SUPERVISE_TEST_LEADER") != "" {
		os.Exit(fakeLeader())
	}
	// A race-enabled binary sleeps a second at exit unless told not to; the
	// supervisor is this binary.
	os.Setenv("GORACE", "atexit_sleep_ms=0")
	goleak.VerifyTestMain(m)
}

// fakeLeader starts a supervised command, prints its pid and blocks until
// killed.
func fakeLeader() int {
	c, err := Start(Options{Command: []string{"sh", "-c", os.Getenv("SUPERVISE_TEST_LEADER")}, Grace: 10 * time.Second, Deadline: farDeadline()})
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	fmt.Println(c.Pid())
	select {}
}

// waitForFile polls for a file holding a pid.
func readPid(t *testing.T, path string) int {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		b, err := os.ReadFile(path)
		if s := strings.TrimSpace(string(b)); err == nil && strings.HasSuffix(string(b), "\n") && s != "" {
			n, err := strconv.Atoi(s)
			if err != nil {
				t.Fatalf("pid file %s: %v", path, err)
			}
			return n
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("no pid in %s", path)
	return 0
}

// farDeadline is a deadline that does not pass during a test.
func farDeadline() Deadline {
	d, err := DeadlineAt(time.Now().Add(time.Hour))
	if err != nil {
		panic(err)
	}
	return d
}

func start(t *testing.T, script string, grace time.Duration) *Child {
	t.Helper()
	c, err := Start(Options{Executable: os.Args[0], Command: []string{"sh", "-c", script}, Grace: grace, Deadline: farDeadline()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Kill() })
	return c
}

func TestExitCodeIsReported(t *testing.T) {
	t.Parallel()
	c := start(t, "exit 7", time.Second)
	if r := c.Result(); r.ExitCode != 7 || r.Code() != 7 || r.Err != nil {
		t.Errorf("result %+v, want exit code 7", r)
	}
}

func TestSignalIsReported(t *testing.T) {
	t.Parallel()
	c := start(t, "kill -USR1 $$", time.Second)
	if r := c.Result(); r.Signal != syscall.SIGUSR1 || r.Code() != 128+int(syscall.SIGUSR1) {
		t.Errorf("result %+v, want killed by SIGUSR1", r)
	}
}

func TestEnvironmentIsPassed(t *testing.T) {
	t.Parallel()
	c, err := Start(Options{Executable: os.Args[0], Command: []string{"sh", "-c", `test "$X_TEST" = yes`},
		Env: append(os.Environ(), "X_TEST=yes"), Grace: time.Second, Deadline: farDeadline()})
	if err != nil {
		t.Fatal(err)
	}
	if r := c.Result(); !r.Success() {
		t.Errorf("result %+v", r)
	}
}

func TestCommandNotFound(t *testing.T) {
	t.Parallel()
	_, err := Start(Options{Executable: os.Args[0], Command: []string{"/nonexistent/prog"}, Grace: time.Second, Deadline: farDeadline()})
	var se *StartError
	if !errors.As(err, &se) || se.Result.ExitCode != 127 {
		t.Fatalf("err %v, want a StartError with exit code 127", err)
	}
	if !strings.Contains(err.Error(), "/nonexistent/prog") {
		t.Errorf("error %q does not name the program", err)
	}
}

func TestStopEndsTheWholeGroup(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	pidFile := filepath.Join(dir, "grandchild")
	c := start(t, fmt.Sprintf("sleep 100 & echo $! > %s; wait", pidFile), 5*time.Second)
	grandchild := readPid(t, pidFile)
	began := time.Now()
	r := c.Stop()
	if r.Signal != syscall.SIGTERM {
		t.Errorf("result %+v, want killed by SIGTERM", r)
	}
	if exists(c.Pid()) || exists(grandchild) {
		t.Errorf("after Stop: command alive %v, grandchild alive %v", exists(c.Pid()), exists(grandchild))
	}
	if took := time.Since(began); took > 3*time.Second {
		t.Errorf("Stop took %v for a group that obeys SIGTERM", took)
	}
}

func TestStopKillsAfterGrace(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ready := filepath.Join(dir, "ready")
	c := start(t, fmt.Sprintf("trap '' TERM; echo $$ > %s; while :; do sleep 0.05; done", ready), 300*time.Millisecond)
	readPid(t, ready)
	began := time.Now()
	r := c.Stop()
	took := time.Since(began)
	if r.Signal != syscall.SIGKILL {
		t.Errorf("result %+v, want killed by SIGKILL", r)
	}
	if took < 300*time.Millisecond || took > 5*time.Second {
		t.Errorf("Stop took %v, want about the 300ms grace", took)
	}
}

func TestLeftoversAreStoppedWhenTheCommandExits(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	pidFile := filepath.Join(dir, "leftover")
	c := start(t, fmt.Sprintf("sleep 100 & echo $! > %s; exit 3", pidFile), 5*time.Second)
	r := c.Result()
	leftover := readPid(t, pidFile)
	if r.ExitCode != 3 {
		t.Errorf("result %+v, want exit code 3", r)
	}
	if exists(leftover) {
		t.Errorf("leftover %d still runs after the command exited", leftover)
	}
}

func TestLeaderDeathKillsTheGroup(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	pidFile := filepath.Join(dir, "grandchild")
	leader := exec.Command(os.Args[0])
	leader.Env = append(os.Environ(), "SUPERVISE_TEST_LEADER="+fmt.Sprintf("trap '' TERM; sleep 100 & echo $! > %s; wait", pidFile))
	out, err := leader.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := leader.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	cmdPid, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil {
		t.Fatalf("fake leader said %q", line)
	}
	grandchild := readPid(t, pidFile)

	if err := leader.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = leader.Wait()
	// Passed once both are seen gone: a look after that could only see a
	// process that took one of their PIDs.
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(2 * time.Millisecond) {
		if !exists(cmdPid) && !exists(grandchild) {
			return
		}
	}
	t.Fatalf("5s after SIGKILL of the leader: command alive %v, grandchild alive %v", exists(cmdPid), exists(grandchild))
}
