//go:build unix

package etcdtest

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

const (
	// stopTimeout bounds the wait for a member to exit after SIGTERM,
	// before it is killed. The member program bounds its own shutdown at
	// 15 seconds.
	stopTimeout = 20 * time.Second

	// killTimeout bounds the wait for a member to exit after SIGKILL.
	killTimeout = 10 * time.Second

	// logTailLines is how many lines of a member's logs go in an error.
	logTailLines = 20
)

// Member is one member of a Cluster: a process of the member program,
// while it runs, and the proxy in front of its client port. Kill, Stop,
// Pause, Resume and Restart fail the test that started the cluster if the
// member is not in a state they apply to, or if they fail; like t.Fatal,
// they must be called from the goroutine running that test.
type Member struct {
	c         *Cluster
	index     int
	name      string
	dataDir   string
	clientURL string // direct
	peerURL   string
	proxy     *proxy
	client    *clientv3.Client // direct; for Status and health checks

	mu     sync.Mutex
	proc   *process // nil when stopped
	paused bool
}

// process is one run of the member program.
type process struct {
	cmd    *exec.Cmd
	ready  chan struct{} // closed when the process writes "ready"
	exited chan struct{} // closed when the process has exited
	err    error         // cmd.Wait's result; read after exited is closed
}

// Name returns the member's etcd name: "m" and its index.
func (m *Member) Name() string { return m.name }

// Endpoint returns the member's client URL through its proxy.
func (m *Member) Endpoint() string { return m.proxy.url }

// DirectEndpoint returns the member's own client URL, which CutClient and
// BlackholeClient do not affect.
func (m *Member) DirectEndpoint() string { return m.clientURL }

// DataDir returns the member's data directory, which holds its logs.
func (m *Member) DataDir() string { return m.dataDir }

// start starts the member program with --initial-cluster-state state.
func (m *Member) start(state string) error {
	c := m.c
	if err := os.MkdirAll(m.dataDir, 0o700); err != nil {
		return err
	}
	stderr, err := os.OpenFile(filepath.Join(m.dataDir, "stderr.log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer stderr.Close() // the process has its own copy
	cmd := exec.Command(c.bin,
		"--name", m.name,
		"--data-dir", m.dataDir,
		"--listen-client", m.clientURL,
		"--advertise-client", m.proxy.url,
		"--listen-peer", m.peerURL,
		"--initial-cluster", c.initial,
		"--initial-cluster-state", state,
		"--initial-cluster-token", c.token,
		"--heartbeat-ms", strconv.FormatInt(c.cfg.heartbeat.Milliseconds(), 10),
		"--election-ms", strconv.FormatInt(c.cfg.election.Milliseconds(), 10),
	)
	cmd.Stderr = stderr
	// The member exits when its standard input closes, as it does when
	// the test binary dies; cmd.Wait closes it only after the member has
	// exited.
	if _, err := cmd.StdinPipe(); err != nil {
		return err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting member %s: %w", m.name, err)
	}
	pid := cmd.Process.Pid
	c.watchdog.watch(pid)
	p := &process{cmd: cmd, ready: make(chan struct{}), exited: make(chan struct{})}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if sc.Text() == "ready" {
				close(p.ready)
				break
			}
		}
		io.Copy(io.Discard, stdout)
		p.err = cmd.Wait()
		c.watchdog.unwatch(pid)
		close(p.exited)
	}()
	m.mu.Lock()
	m.proc, m.paused = p, false
	m.mu.Unlock()
	return nil
}

// WaitReady waits until the member is ready: it has joined the cluster and
// serves clients. A member becomes ready only once the cluster has a
// quorum. WaitReady returns an error if the member is stopped, exits
// first, or ctx ends first.
func (m *Member) WaitReady(ctx context.Context) error {
	m.mu.Lock()
	p := m.proc
	m.mu.Unlock()
	if p == nil {
		return fmt.Errorf("etcdtest: member %s is stopped", m.name)
	}
	select {
	case <-p.ready:
		return nil
	case <-p.exited:
		return fmt.Errorf("etcdtest: member %s exited before it was ready (%v)%s", m.name, p.err, m.logTail())
	case <-ctx.Done():
		return fmt.Errorf("etcdtest: member %s not ready: %w%s", m.name, ctx.Err(), m.logTail())
	}
}

// Running reports whether the member's process runs, paused or not.
func (m *Member) Running() bool {
	m.mu.Lock()
	p := m.proc
	m.mu.Unlock()
	return p != nil && !p.hasExited()
}

// live reports whether the member runs and is not paused.
func (m *Member) live() bool {
	m.mu.Lock()
	p, paused := m.proc, m.paused
	m.mu.Unlock()
	return p != nil && !paused && !p.hasExited()
}

// Kill kills the member with SIGKILL, as a crash would, and waits for it
// to exit. What it wrote survives, although it does not fsync, as the
// operating system keeps running. Kill fails the test if the member is
// stopped.
func (m *Member) Kill() {
	m.c.t.Helper()
	p := m.take("Kill")
	if err := p.kill(); err != nil {
		m.c.t.Fatalf("etcdtest: killing member %s: %v", m.name, err)
	}
}

// Stop stops the member with SIGTERM, resuming it first if it is paused,
// and waits for it to exit; a leader hands its leadership over first. It
// fails the test if the member does not exit with status 0 within 20
// seconds, and then kills it.
func (m *Member) Stop() {
	m.c.t.Helper()
	p := m.take("Stop")
	p.cmd.Process.Signal(syscall.SIGTERM)
	p.cmd.Process.Signal(syscall.SIGCONT)
	select {
	case <-p.exited:
		if p.err != nil {
			m.c.t.Fatalf("etcdtest: member %s exited after SIGTERM: %v%s", m.name, p.err, m.logTail())
		}
	case <-time.After(stopTimeout):
		p.kill()
		m.c.t.Fatalf("etcdtest: member %s still running %v after SIGTERM; killed it%s", m.name, stopTimeout, m.logTail())
	}
}

// take marks the member stopped and returns its process, or fails the
// test, naming op, if it is already stopped.
func (m *Member) take(op string) *process {
	m.c.t.Helper()
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.proc == nil {
		m.c.t.Fatalf("etcdtest: %s member %s: it is stopped", op, m.name)
	}
	p := m.proc
	m.proc, m.paused = nil, false
	return p
}

// Pause stops the member's process with SIGSTOP: it holds its connections
// and ports but answers nothing, as a member stuck in a long pause would.
func (m *Member) Pause() {
	m.c.t.Helper()
	m.signal("Pause", syscall.SIGSTOP, true)
}

// Resume resumes a member paused with Pause, with SIGCONT.
func (m *Member) Resume() {
	m.c.t.Helper()
	m.signal("Resume", syscall.SIGCONT, false)
}

func (m *Member) signal(op string, sig syscall.Signal, paused bool) {
	m.c.t.Helper()
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.proc == nil || m.proc.hasExited() {
		m.c.t.Fatalf("etcdtest: %s member %s: it is not running", op, m.name)
	}
	if m.paused == paused {
		m.c.t.Fatalf("etcdtest: %s member %s: it is already %s", op, m.name, map[bool]string{true: "paused", false: "running"}[paused])
	}
	if err := m.proc.cmd.Process.Signal(sig); err != nil {
		m.c.t.Fatalf("etcdtest: %s member %s: %v", op, m.name, err)
	}
	m.paused = paused
}

// Restart starts a stopped or killed member again, with the same name,
// ports and data directory, and --initial-cluster-state existing. It does
// not wait for the member to be ready, which takes a quorum, perhaps of
// members not restarted yet: see WaitReady and Cluster.WaitHealthy. It
// fails the test if the member is running, or if its process does not
// start; it cannot choose other ports if another process took the
// member's meanwhile, and the member then exits (WaitReady says why).
func (m *Member) Restart() {
	m.c.t.Helper()
	m.mu.Lock()
	p := m.proc
	m.mu.Unlock()
	if p != nil {
		if !p.hasExited() {
			m.c.t.Fatalf("etcdtest: Restart member %s: it is running", m.name)
		}
		// It exited by itself: reap it first.
		m.take("Restart")
	}
	if err := m.start("existing"); err != nil {
		m.c.t.Fatalf("etcdtest: Restart member %s: %v", m.name, err)
	}
}

// CutClient cuts the member off from its clients: its proxy resets every
// client connection at once, and every new one as soon as it is
// accepted, until HealClient. The member and its peers do not notice. A
// client that has only this member's endpoint fails its requests when
// their context ends (etcd's client waits for a connection), or at once
// with a gRPC call option of WaitForReady(false).
func (m *Member) CutClient() {
	m.proxy.cut()
}

// BlackholeClient makes the member's proxy swallow its clients'
// connections until HealClient: it keeps them, and accepts new ones, but
// forwards nothing either way, as a network that drops packets would. It
// closes the proxy's connections to the member.
func (m *Member) BlackholeClient() {
	m.proxy.blackhole()
}

// HealClient undoes CutClient or BlackholeClient: the proxy forwards new
// connections again. It closes the connections it was blackholing, so
// that their clients connect anew rather than wait for answers that never
// come.
func (m *Member) HealClient() {
	m.proxy.heal()
}

// hasExited reports whether the process has exited.
func (p *process) hasExited() bool {
	select {
	case <-p.exited:
		return true
	default:
		return false
	}
}

// kill kills the process with SIGKILL, if it has not exited, and waits
// for it to exit.
func (p *process) kill() error {
	p.cmd.Process.Signal(syscall.SIGKILL)
	select {
	case <-p.exited:
		return nil
	case <-time.After(killTimeout):
		return fmt.Errorf("still running %v after SIGKILL", killTimeout)
	}
}

// logTail returns the last lines of the member's standard error and etcd
// log, each under a heading, or "" if both are empty.
func (m *Member) logTail() string {
	var b strings.Builder
	for _, name := range []string{"stderr.log", "etcd.log"} {
		data, err := os.ReadFile(filepath.Join(m.dataDir, name))
		if err != nil || len(data) == 0 {
			continue
		}
		lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
		lines = lines[max(0, len(lines)-logTailLines):]
		fmt.Fprintf(&b, "\n%s %s:\n%s", m.name, name, strings.Join(lines, "\n"))
	}
	return b.String()
}

// portInUse reports whether the member could not bind a port, as its
// standard error or log says.
func (m *Member) portInUse() bool {
	return strings.Contains(m.logTail(), "address already in use")
}
