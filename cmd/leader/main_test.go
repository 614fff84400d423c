//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/leaderelect/leader/internal/pgtest"
)

// leaderBin is the leader binary the end-to-end tests run, built once by
// TestMain.
var leaderBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "leader-e2e-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	leaderBin = filepath.Join(dir, "leader")
	build := exec.Command("go", "build", "-o", leaderBin, ".")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintf(os.Stderr, "building the leader binary: %v\n", err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	var ignore []goleak.Option
	for _, f := range embedGoleakOptions {
		ignore = append(ignore, goleak.IgnoreAnyFunction(f))
	}
	code := pgtest.Run(m, ignore...) // stops the shared PostgreSQL and checks for leaked goroutines
	os.RemoveAll(dir)
	os.Exit(code)
}

// embedGoleakOptions are the functions of the goroutines that an
// embedded etcd server (TestEtcdStoreOverTLS) leaves behind after Close,
// which TestMain's check for leaked goroutines leaves out.
var embedGoleakOptions = []string{
	"go.opencensus.io/stats/view.(*worker).start",
	"github.com/golang/glog.(*fileSink).flushDaemon",
}

// env is an isolated environment for the processes of one test: its own
// fence directory and default store directory, no LEADER_STORE from the
// caller's environment.
type env struct {
	t    *testing.T
	dir  string
	vars []string
}

func newEnv(t *testing.T) *env {
	t.Helper()
	dir := t.TempDir()
	var vars []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		switch k {
		case "LEADER_STORE", "XDG_RUNTIME_DIR", "XDG_STATE_HOME", "LEADER_NAME", "LEADER_ID", "LEADER_TERM", "LEADER_HELD":
			continue
		}
		vars = append(vars, kv)
	}
	vars = append(vars,
		"XDG_RUNTIME_DIR="+filepath.Join(dir, "run"),
		"XDG_STATE_HOME="+filepath.Join(dir, "state"),
	)
	return &env{t: t, dir: dir, vars: vars}
}

// fileStore returns a fresh embedded store URL.
func (e *env) fileStore() string {
	d := filepath.Join(e.dir, "store")
	return "file://" + d
}

// with returns a copy of e with more variables.
func (e *env) with(kv ...string) *env {
	c := *e
	c.vars = append(append([]string(nil), e.vars...), kv...)
	return &c
}

// proc is a running leader process.
type proc struct {
	t      *testing.T
	cmd    *exec.Cmd
	stdout lockedBuffer
	stderr lockedBuffer
	done   chan struct{}
	code   int
}

type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// start starts the leader binary with args.
func (e *env) start(args ...string) *proc {
	e.t.Helper()
	p := &proc{t: e.t, done: make(chan struct{})}
	p.cmd = exec.Command(leaderBin, args...)
	p.cmd.Env = e.vars
	p.cmd.Dir = e.dir
	p.cmd.Stdout = &p.stdout
	p.cmd.Stderr = &p.stderr
	// A process left behind by a broken build may hold the output pipes
	// open; do not wait for it.
	p.cmd.WaitDelay = 2 * time.Second
	if err := p.cmd.Start(); err != nil {
		e.t.Fatal(err)
	}
	go func() {
		err := p.cmd.Wait()
		p.code = exitCodeOf(err, p.cmd.ProcessState)
		close(p.done)
	}()
	e.t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = p.cmd.Process.Kill()
			<-p.done
		}
		if e.t.Failed() {
			e.t.Logf("leader %s\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), p.stdout.String(), p.stderr.String())
		}
	})
	return p
}

func exitCodeOf(err error, st *os.ProcessState) int {
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		return -1000
	}
	if st == nil {
		return -1000
	}
	if ws, ok := st.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return 128 + int(ws.Signal())
	}
	return st.ExitCode()
}

// run runs the leader binary to completion (within a minute).
func (e *env) run(args ...string) (stdout, stderr string, code int) {
	e.t.Helper()
	p := e.start(args...)
	code = p.wait(time.Minute)
	return p.stdout.String(), p.stderr.String(), code
}

// wait waits for the process to exit and returns its exit code.
func (p *proc) wait(limit time.Duration) int {
	p.t.Helper()
	select {
	case <-p.done:
		return p.code
	case <-time.After(limit):
		p.t.Fatalf("leader %v still running after %v\nstderr:\n%s", p.cmd.Args[1:], limit, p.stderr.String())
		return 0
	}
}

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

func (p *proc) signal(sig syscall.Signal) {
	p.t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		p.t.Fatalf("signal %v: %v", sig, err)
	}
}

// waitFor polls cond until it holds or limit passes.
func waitFor(t *testing.T, limit time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", limit, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// childScript is the command the tests elect. At start it checks that no
// process logged by an earlier child (children and their own children) still
// runs, and logs "overlap" if one does; then it starts a grandchild, logs
// both pids and its start, and runs until SIGTERM, which it logs.
//
// Without /proc (macOS, the BSDs) it tells running processes from zombies
// with ps, and where date has no %N (macOS) it takes sub-second times from
// perl or python3.
const childScript = `
log="$CHILD_LOG"
runs() {
  if [ -r /proc/$$/stat ]; then
    [ -r /proc/$1/stat ] && [ "$(cut -d' ' -f3 /proc/$1/stat 2>/dev/null)" != Z ]
  else
    kill -0 "$1" 2>/dev/null && [ "$(ps -o stat= -p "$1" 2>/dev/null | cut -c1)" != Z ]
  fi
}
now() {
  t=$(date +%s.%N)
  case $t in
  *[!0-9.]*) perl -MTime::HiRes=time -e 'printf "%.6f\n", time' 2>/dev/null ||
    python3 -c 'import time; print("%.6f" % time.time())' ;;
  *) echo "$t" ;;
  esac
}
for p in $(awk '$1=="pid"{print $2}' "$log" 2>/dev/null); do
  if runs "$p"; then
    echo "overlap $$ $p $(now)" >> "$log"
  fi
done
sleep 1000 &
echo "pid $! grandchild $$" >> "$log"
echo "pid $$ child" >> "$log"
trap 'echo "stop $$ $(now)" >> "$log"; exit 0' TERM
echo "start $$ $(now) $LEADER_ID $LEADER_TERM $LEADER_HELD $LEADER_NAME" >> "$log"
wait
`

// childLog is the log the children of one test append to.
type childLog struct {
	t    *testing.T
	path string
}

type childEvent struct {
	kind   string // start, stop, pid, overlap
	pid    int
	at     time.Time
	fields []string
}

func (l childLog) events() []childEvent {
	b, err := os.ReadFile(l.path)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		l.t.Fatal(err)
	}
	var out []childEvent
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		ev := childEvent{kind: f[0], fields: f}
		ev.pid, _ = strconv.Atoi(f[1])
		if (ev.kind == "start" || ev.kind == "stop") && len(f) > 2 {
			if secs, err := strconv.ParseFloat(f[2], 64); err == nil {
				ev.at = time.Unix(0, int64(secs*1e9))
			}
		}
		out = append(out, ev)
	}
	return out
}

func (l childLog) starts() []childEvent {
	var out []childEvent
	for _, ev := range l.events() {
		if ev.kind == "start" {
			out = append(out, ev)
		}
	}
	return out
}

func (l childLog) String() string {
	b, _ := os.ReadFile(l.path)
	return string(b)
}

// running returns the pids of logged children that still run.
func (l childLog) running() []int {
	var out []int
	for _, ev := range l.events() {
		if ev.kind == "pid" && len(ev.fields) > 2 && ev.fields[2] == "child" && pidAlive(ev.pid) {
			out = append(out, ev.pid)
		}
	}
	return out
}

// checkNoOverlap fails t if a child found an earlier one alive at its start.
func (l childLog) checkNoOverlap() {
	l.t.Helper()
	for _, ev := range l.events() {
		if ev.kind == "overlap" {
			l.t.Errorf("child %d started while pid %s of an earlier child still ran\nlog:\n%s", ev.pid, ev.fields[2], l)
		}
	}
}

// assertAtMostOneRunsFor watches for a while that at most one child runs.
func (l childLog) assertAtMostOneRunsFor(d time.Duration) {
	l.t.Helper()
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		if r := l.running(); len(r) > 1 {
			l.t.Fatalf("%d children run at once: %v\nlog:\n%s", len(r), r, l)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// candidates starts n "leader run" instances with ids c0..c(n-1) running the
// child script.
func (e *env) candidates(n int, log childLog, store string, extra ...string) map[string]*proc {
	e.t.Helper()
	script := filepath.Join(e.dir, "child.sh")
	if err := os.WriteFile(script, []byte(childScript), 0o755); err != nil {
		e.t.Fatal(err)
	}
	ce := e.with("CHILD_LOG=" + log.path)
	out := make(map[string]*proc)
	for i := range n {
		id := "c" + strconv.Itoa(i)
		args := append([]string{"run", "--store", store, "--name", "e2e", "--id", id}, extra...)
		args = append(args, "--", "sh", script)
		out[id] = ce.start(args...)
	}
	return out
}

func newChildLog(t *testing.T, e *env) childLog {
	return childLog{t: t, path: filepath.Join(e.dir, "children.log")}
}

// ctxFor returns a context ended with the test.
func ctxFor(t *testing.T) context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	return ctx
}
