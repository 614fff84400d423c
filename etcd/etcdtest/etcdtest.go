//go:build unix

// Package etcdtest runs etcd clusters for tests: each member a separate OS
// process on loopback ports, each member's client port behind a proxy that
// a test can cut or blackhole. It is for end-to-end and fault tests: kill a
// member, pause one, cut a client off from one, lose quorum and recover.
//
// StartCluster builds the member program (package internal/etcdserver of
// this module) once per test binary, starts the members, and stops them
// and removes their data when the test ends. Clients use the proxied
// Endpoints; each member advertises its proxied URL, so a client that
// syncs its endpoints from the cluster stays behind the proxies.
//
// Members do not fsync, and log at level error to etcd.log in their data
// directory; their standard error goes to stderr.log beside it. A member
// exits when the test binary dies, even a paused one (a watchdog process
// per cluster kills it), so no member outlives the test binary.
//
// The package runs on Unix only: it stops and resumes members with
// SIGSTOP and SIGCONT.
package etcdtest

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
)

const (
	// startTimeout bounds the start of a cluster: every member ready and
	// a leader elected.
	startTimeout = 30 * time.Second

	// startAttempts is how many times StartCluster starts a cluster whose
	// ports another process took before its members bound them.
	startAttempts = 3

	// pollInterval is the wait between two checks of LeaderIndex and
	// WaitHealthy.
	pollInterval = 50 * time.Millisecond

	// statusTimeout bounds one request of LeaderIndex or WaitHealthy to
	// one member.
	statusTimeout = time.Second
)

// errPortInUse says that a member could not bind one of its ports.
var errPortInUse = errors.New("a member's port is in use")

// config is what the Options set.
type config struct {
	heartbeat time.Duration
	election  time.Duration
}

// An Option changes how StartCluster starts a cluster.
type Option func(*config)

// ElectionTiming sets the members' heartbeat interval and election timeout
// (etcd's --heartbeat-interval and --election-timeout), which default to
// 100ms and 1s, as in etcd. They are rounded down to whole milliseconds.
// The election timeout bounds how long a cluster goes without a leader
// after its leader dies, and sets the shortest lease TTL etcd grants: 1.5
// election timeouts, rounded up to whole seconds.
func ElectionTiming(heartbeat, election time.Duration) Option {
	return func(c *config) { c.heartbeat, c.election = heartbeat, election }
}

// Cluster is a running etcd cluster, started by StartCluster for a test.
// Member's Kill, Stop, Pause, Resume and Restart fail that test when they
// fail, so, like t.Fatal, they must be called from the goroutine running
// it. The other methods of Cluster and Member may be called from any
// goroutine.
type Cluster struct {
	t        testing.TB
	bin      string // the member program
	dir      string // temporary; holds a directory per member
	token    string // the cluster's --initial-cluster-token
	cfg      config
	initial  string // --initial-cluster
	members  []*Member
	watchdog *watchdog
}

// StartCluster starts an etcd cluster of n members, and waits until every
// member is ready and the cluster has a leader. It stops the members, the
// proxies and the watchdog, and removes the members' data, when t ends. It
// fails t if the cluster does not start within 30 seconds.
//
// Each member listens on two free ports of 127.0.0.1, one for clients and
// one for peers. If another process takes one of them before the member
// binds it, StartCluster starts the whole cluster again on other ports,
// three times at most.
func StartCluster(t testing.TB, n int, opts ...Option) *Cluster {
	t.Helper()
	if n < 1 {
		t.Fatalf("etcdtest: StartCluster with %d members", n)
	}
	cfg := config{heartbeat: 100 * time.Millisecond, election: time.Second}
	for _, o := range opts {
		o(&cfg)
	}
	bin := Build(t)
	for attempt := 1; ; attempt++ {
		ports, err := freePorts(2 * n)
		if err != nil {
			t.Fatalf("etcdtest: %v", err)
		}
		c, err := startCluster(t, bin, cfg, ports)
		if err == nil {
			t.Cleanup(c.stop)
			return c
		}
		if attempt < startAttempts && errors.Is(err, errPortInUse) {
			continue
		}
		t.Fatalf("etcdtest: starting a cluster of %d members: %v", n, err)
	}
}

// startCluster starts a cluster of len(ports)/2 members, member i on
// ports[2i] for clients and ports[2i+1] for peers. On error, it stops
// what it started.
func startCluster(t testing.TB, bin string, cfg config, ports []int) (_ *Cluster, err error) {
	n := len(ports) / 2
	c := &Cluster{t: t, bin: bin, cfg: cfg, token: randomHex(8)}
	c.dir, err = os.MkdirTemp("", "leader-etcdtest-")
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			c.stop()
		}
	}()
	if c.watchdog, err = startWatchdog(bin, c.dir); err != nil {
		return nil, err
	}
	var initial []string
	for i := range n {
		m := &Member{
			c:         c,
			index:     i,
			name:      "m" + strconv.Itoa(i),
			clientURL: loopbackURL(ports[2*i]),
			peerURL:   loopbackURL(ports[2*i+1]),
		}
		m.dataDir = filepath.Join(c.dir, m.name)
		if m.proxy, err = startProxy(strings.TrimPrefix(m.clientURL, "http://")); err != nil {
			return nil, err
		}
		if m.client, err = newDirectClient(m.clientURL); err != nil {
			return nil, err
		}
		c.members = append(c.members, m)
		initial = append(initial, m.name+"="+m.peerURL)
	}
	c.initial = strings.Join(initial, ",")

	for _, m := range c.members {
		if err := m.start("new"); err != nil {
			return nil, err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	if err := c.waitReady(ctx); err != nil {
		for _, m := range c.members {
			if m.portInUse() {
				return nil, fmt.Errorf("%w: %v", errPortInUse, err)
			}
		}
		return nil, err
	}
	if _, err := c.LeaderIndex(ctx); err != nil {
		return nil, err
	}
	return c, nil
}

// waitReady waits until every member is ready. It gives up as soon as one
// exits, as the others then may never be, and returns that member's
// error.
func (c *Cluster) waitReady(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errs := make([]error, len(c.members))
	var wg sync.WaitGroup
	for i, m := range c.members {
		wg.Go(func() {
			if errs[i] = m.WaitReady(ctx); errs[i] != nil {
				cancel()
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil && !errors.Is(err, context.Canceled) {
			return err
		}
	}
	return errors.Join(errs...)
}

// stop kills the members and waits for them to exit, stops the proxies,
// the clients and the watchdog, and removes the cluster's directory. If
// the test failed, it first logs the tail of each member's logs.
func (c *Cluster) stop() {
	if c.t.Failed() {
		for _, m := range c.members {
			if tail := m.logTail(); tail != "" {
				c.t.Logf("etcdtest: logs of member %s:%s", m.name, tail)
			}
		}
	}
	for _, m := range c.members {
		if m.client != nil {
			m.client.Close()
		}
	}
	for _, m := range c.members {
		m.mu.Lock()
		p := m.proc
		m.proc, m.paused = nil, false
		m.mu.Unlock()
		if p != nil {
			p.kill()
		}
	}
	for _, m := range c.members {
		if m.proxy != nil {
			m.proxy.close()
		}
	}
	if c.watchdog != nil {
		c.watchdog.stop()
	}
	if err := os.RemoveAll(c.dir); err != nil {
		c.t.Errorf("etcdtest: removing the cluster's directory: %v", err)
	}
}

// Endpoints returns the members' client URLs through their proxies, in
// member order: the URLs for the clients under test.
func (c *Cluster) Endpoints() []string {
	eps := make([]string, len(c.members))
	for i, m := range c.members {
		eps[i] = m.Endpoint()
	}
	return eps
}

// DirectEndpoints returns the members' own client URLs, in member order:
// clients that use them are not affected by CutClient and BlackholeClient.
func (c *Cluster) DirectEndpoints() []string {
	eps := make([]string, len(c.members))
	for i, m := range c.members {
		eps[i] = m.DirectEndpoint()
	}
	return eps
}

// Member returns the member of index i, from 0 to the cluster's size
// minus one.
func (c *Cluster) Member(i int) *Member {
	return c.members[i]
}

// LeaderIndex waits until the cluster has a leader, and returns its
// member index. A leader is a member that says it is leader, and that a
// majority of the cluster's members say is leader, each asked with the
// maintenance Status API on its direct endpoint; paused and stopped
// members are not asked. It returns -1 and an error wrapping ctx.Err() if
// ctx ends first.
func (c *Cluster) LeaderIndex(ctx context.Context) (int, error) {
	for {
		i, err := c.leader(ctx)
		if err == nil {
			return i, nil
		}
		select {
		case <-ctx.Done():
			return -1, fmt.Errorf("etcdtest: no leader: %w (last check: %v)", ctx.Err(), err)
		case <-time.After(pollInterval):
		}
	}
}

// leader asks every live member its status once, and returns the index of
// the leader if there is one.
func (c *Cluster) leader(ctx context.Context) (int, error) {
	statuses := c.statuses(ctx)
	byID := make(map[uint64]int)  // member ID to index
	votes := make(map[uint64]int) // leader ID to how many say so
	var errs []error
	for i, s := range statuses {
		switch {
		case s.err != nil:
			errs = append(errs, fmt.Errorf("%s: %w", c.members[i].name, s.err))
		case s.resp != nil:
			byID[s.resp.Header.MemberId] = i
			if s.resp.Leader != 0 {
				votes[s.resp.Leader]++
			}
		}
	}
	for id, n := range votes {
		i, ok := byID[id]
		if ok && n > len(c.members)/2 && statuses[i].resp.Leader == id {
			return i, nil
		}
	}
	if len(errs) > 0 {
		return -1, errors.Join(errs...)
	}
	return -1, errors.New("no member is leader with a majority's agreement")
}

// status is one member's answer to Status; both fields are nil for a
// member not asked.
type status struct {
	resp *clientv3.StatusResponse
	err  error
}

// statuses asks every live member its status, at once.
func (c *Cluster) statuses(ctx context.Context) []status {
	out := make([]status, len(c.members))
	var wg sync.WaitGroup
	for i, m := range c.members {
		if !m.live() {
			continue
		}
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(ctx, statusTimeout)
			defer cancel()
			out[i].resp, out[i].err = m.client.Status(ctx, m.clientURL)
		})
	}
	wg.Wait()
	return out
}

// WaitHealthy waits until every member that is running and not paused is
// ready, the cluster has a leader (see LeaderIndex), and a linearizable
// read through each of those members succeeds, on their direct endpoints.
// It returns an error wrapping ctx.Err() if ctx ends first. Stopped and
// paused members are left out, so a cluster with a member down is healthy
// if the others have a quorum.
func (c *Cluster) WaitHealthy(ctx context.Context) error {
	for {
		err := c.healthy(ctx)
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("etcdtest: cluster not healthy: %w (last check: %v)", ctx.Err(), err)
		case <-time.After(pollInterval):
		}
	}
}

func (c *Cluster) healthy(ctx context.Context) error {
	for _, m := range c.members {
		m.mu.Lock()
		p, paused := m.proc, m.paused
		m.mu.Unlock()
		if p == nil || paused {
			continue
		}
		select {
		case <-p.ready:
		case <-p.exited:
			return fmt.Errorf("%s exited: %v", m.name, p.err)
		default:
			return fmt.Errorf("%s not ready", m.name)
		}
	}
	if _, err := c.leader(ctx); err != nil {
		return err
	}
	for _, m := range c.members {
		if !m.live() {
			continue
		}
		ctx, cancel := context.WithTimeout(ctx, statusTimeout)
		_, err := m.client.Get(ctx, "etcdtest-health")
		cancel()
		if err != nil {
			return fmt.Errorf("%s: linearizable read: %w", m.name, err)
		}
	}
	return nil
}

// newDirectClient returns a client of the member at url, for Status and
// health checks. It reconnects at most half a second after the member is
// back, where gRPC's default backoff would wait up to two minutes.
func newDirectClient(url string) (*clientv3.Client, error) {
	return clientv3.New(clientv3.Config{
		Endpoints: []string{url},
		DialOptions: []grpc.DialOption{grpc.WithConnectParams(grpc.ConnectParams{
			Backoff: backoff.Config{
				BaseDelay:  50 * time.Millisecond,
				Multiplier: 1.6,
				Jitter:     0.2,
				MaxDelay:   500 * time.Millisecond,
			},
			MinConnectTimeout: time.Second,
		})},
	})
}

// freePorts returns n distinct ports of 127.0.0.1 that were free a moment
// ago: it holds them all open until it has them all.
func freePorts(n int) ([]int, error) {
	ports := make([]int, 0, n)
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		defer ln.Close()
		ports = append(ports, ln.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

func loopbackURL(port int) string {
	return "http://" + net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
}

func randomHex(n int) string {
	b := make([]byte, n)
	crand.Read(b)
	return hex.EncodeToString(b)
}

// watchdog is a process of the member program in --watchdog mode: when its
// standard input, a pipe from the test binary, closes, it kills the
// members it watches and removes the cluster's directory. The test binary
// tells it the process ID of each member it starts, and of each member
// that exits.
type watchdog struct {
	cmd *exec.Cmd

	mu    sync.Mutex // serializes writes to stdin
	stdin io.WriteCloser
}

func startWatchdog(bin, dir string) (*watchdog, error) {
	w := &watchdog{cmd: exec.Command(bin, "--watchdog", dir)}
	var err error
	if w.stdin, err = w.cmd.StdinPipe(); err != nil {
		return nil, err
	}
	if err := w.cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting the watchdog: %w", err)
	}
	return w, nil
}

// watch tells the watchdog to kill process pid if the test binary dies;
// unwatch tells it to no longer. A watchdog that died cannot be told, and
// its members exit anyway when the test binary dies, unless paused.
func (w *watchdog) watch(pid int)   { w.send('+', pid) }
func (w *watchdog) unwatch(pid int) { w.send('-', pid) }

func (w *watchdog) send(op byte, pid int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	fmt.Fprintf(w.stdin, "%c%d\n", op, pid)
}

// stop closes the watchdog's standard input and waits for it to exit.
func (w *watchdog) stop() {
	w.mu.Lock()
	w.stdin.Close()
	w.mu.Unlock()
	w.cmd.Wait()
}
