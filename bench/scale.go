package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/leaderelect/leader"
	etcdstore "github.com/leaderelect/leader/etcd"
	"github.com/leaderelect/leader/postgres"
)

// The scale measurements of issue 6, on the lease strategy (the advisory
// strategy holds a server connection per candidate, so it is not meant for
// thousands of names), and the first of them also on the etcd store
// (leader-etcd-scale-10k: its renewal rounds counted in keep-alives, see
// etcdScaleCounter):
//
//   - One process holding many names (10,000): every Elector of the process
//     renews on one grid of period RenewInterval, and the store sends each
//     round's renewals as one statement (UPDATE ... FROM unnest(...)). The
//     child (role scale-names) counts the renewal statements with its pgx
//     tracer, times each, groups the Electors' Renew calls into rounds,
//     and counts losses of leadership.
//   - Many processes (100) campaigning for the same names (100 each): every
//     name has one leader and a follower in each other process. Each child
//     (role scale-proc) counts its statements by kind; the parent follows
//     every election and demotion.

const (
	// scaleRole is the database role of every scale process.
	scaleRole = "lb_scale"

	scScaleNames = "scale-one-process"
	scScaleProcs = "scale-processes"

	// scaleNamePrefix names the elections: scale-00000, scale-00001, ...
	scaleNamePrefix = "scale"
	// scaleProcPoolConns is the pool size of each process of the
	// many-processes measurement (the store's listener has a connection of
	// its own besides): few, so that a hundred processes stay lean.
	scaleProcPoolConns = 2

	// Commands to scale children: a scale-names child starts its window
	// at "mark" and reports it at "report"; a scale-proc child starts
	// campaigning at "campaign" (and answers "counts" and "exit").
	cmdMark     = "mark"
	cmdReport   = "report"
	cmdCampaign = "campaign"
)

func scaleName(i int) string { return fmt.Sprintf("%s-%05d", scaleNamePrefix, i) }

// scaleRun is one scale measurement of a plan.
type scaleRun struct {
	name     string // the setup name: lease-scale-10k, lease-scale-100x100, leader-etcd-scale-10k
	kind     string // kindLease, or kindLeaderEtcd (one process's names only)
	scenario string
	timing   timing
	names    int // per process
	procs    int
	window   time.Duration
}

func (p plan) scaleRuns() []scaleRun {
	t := timingAt(kindLease, p.scaleTTL)
	return []scaleRun{
		{name: "lease-scale-" + countName(p.scaleNames), kind: kindLease, scenario: scScaleNames, timing: t,
			names: p.scaleNames, procs: 1, window: p.scaleNamesWindow},
		{name: fmt.Sprintf("lease-scale-%dx%d", p.scaleProcs, p.scaleProcNames), kind: kindLease, scenario: scScaleProcs, timing: t,
			names: p.scaleProcNames, procs: p.scaleProcs, window: p.scaleProcsWindow},
		// Ours on the etcd store: one process's names, counted in
		// keep-alives (one per round, however many names).
		{name: "leader-etcd-scale-" + countName(p.scaleNames), kind: kindLeaderEtcd, scenario: scScaleNames,
			timing: timingAt(kindLeaderEtcd, p.scaleTTL), names: p.scaleNames, procs: 1, window: p.scaleNamesWindow},
	}
}

// countName writes 10000 as 10k.
func countName(n int) string {
	if n >= 1000 && n%1000 == 0 {
		return fmt.Sprintf("%dk", n/1000)
	}
	return strconv.Itoa(n)
}

// scaleStore opens a scale process's pool (with tracer on its connections,
// which the store's listener also uses) and lease store, and checks the
// pool's connection.
func scaleStore(spec childSpec, tracer *scaleTracer, logger *slog.Logger) (*postgres.LeaseStore, error) {
	cfg, err := pgxpool.ParseConfig(spec.ConnString)
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.Tracer = tracer
	if spec.PoolConns > 0 {
		cfg.MaxConns = int32(spec.PoolConns)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		return nil, err
	}
	store, err := postgres.NewLeaseStore(pool, postgres.Options{Logger: logger})
	if err != nil {
		pool.Close()
		return nil, err
	}
	if err := pingPool(pool)(); err != nil {
		store.Close()
		pool.Close()
		return nil, err
	}
	return store, nil
}

// scaleMetrics is the leader.Metrics of one Elector of a scale process:
// it hands its Renew calls to a round recorder, counts losses by reason,
// and reports the Elector's first acquire attempt.
type scaleMetrics struct {
	leader.NopMetrics
	rec          *roundRecorder // nil: no rounds
	maxRenew     *maxMs         // nil: not kept
	losses       *lossCounter   // nil: not counted
	onLost       func(reason string)
	firstAttempt func() // nil: none
	once         sync.Once
}

func (m *scaleMetrics) StoreCall(_, op string, took time.Duration, err error) {
	switch op {
	case "renew":
		if m.rec != nil {
			end := time.Now()
			m.rec.call(end.Add(-took), end, err)
		}
		if m.maxRenew != nil {
			m.maxRenew.add(took)
		}
	case "acquire":
		if m.firstAttempt != nil {
			m.once.Do(m.firstAttempt)
		}
	}
}

func (m *scaleMetrics) Lost(_ string, reason leader.LossReason) {
	if m.losses != nil {
		m.losses.add(string(reason))
	}
	if m.onLost != nil {
		m.onLost(string(reason))
	}
}

// maxMs keeps the longest of some durations, until taken.
type maxMs struct {
	mu sync.Mutex
	ms float64
}

func (m *maxMs) add(d time.Duration) {
	m.mu.Lock()
	m.ms = max(m.ms, msDur(d))
	m.mu.Unlock()
}

// take returns the longest and starts again.
func (m *maxMs) take() float64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	v := m.ms
	m.ms = 0
	return v
}

type lossCounter struct {
	mu sync.Mutex
	n  map[string]int64
}

func (c *lossCounter) add(reason string) {
	c.mu.Lock()
	if c.n == nil {
		c.n = map[string]int64{}
	}
	c.n[reason]++
	c.mu.Unlock()
}

func (c *lossCounter) snapshot() map[string]int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[string]int64, len(c.n))
	for k, v := range c.n {
		out[k] = v
	}
	return out
}

// --- the parent's side ---

// nextEvent waits for an event named want from a child, failing on an
// "error" event, on the child's exit, or after timeout.
func nextEvent(events <-chan event, who, want string, timeout time.Duration) (event, error) {
	deadline := time.After(timeout)
	for {
		select {
		case ev, ok := <-events:
			if !ok {
				return ev, fmt.Errorf("the %s process exited", who)
			}
			if ev.Ev == "error" {
				return ev, fmt.Errorf("%s process: %s", who, ev.Msg)
			}
			if ev.Ev == want {
				return ev, nil
			}
		case <-deadline:
			return event{}, fmt.Errorf("no %q from the %s process within %v", want, who, timeout)
		}
	}
}

// measureScale runs one scale measurement.
func (b *bench) measureScale(ctx context.Context, sc scaleRun) Result {
	var r Result
	if sc.scenario == scScaleNames {
		b.logf("%s: %d names in one process (%s), window %v", sc.name, sc.names, sc.timing, sc.window)
		r = b.measureScaleNames(ctx, sc)
	} else {
		b.logf("%s: %d processes × %d names (%s), window %v", sc.name, sc.procs, sc.names, sc.timing, sc.window)
		r = b.measureScaleProcs(ctx, sc)
	}
	if len(r.SamplesMs) > 0 {
		sum := summarize(r.SamplesMs)
		r.Summary = &sum
	}
	b.logf("%s done in %.0fs", sc.name, r.WallSec)
	return r
}

// progressSleep sleeps for d, logging progress every minute of a long wait.
func (b *bench) progressSleep(name string, d time.Duration, sleep func(time.Duration)) {
	for left := d; left > 0; {
		step := min(left, time.Minute)
		sleep(step)
		left -= step
		if left > 0 {
			b.logf("  %s: %v of the %v window", name, (d - left).Round(time.Second), d)
		}
	}
}

// cpuTimes is the first line of /proc/stat: the machine's CPU time, in
// clock ticks, in all and idle (idle and iowait).
type cpuTimes struct{ total, idle float64 }

func readCPU() cpuTimes {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return cpuTimes{}
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	var t cpuTimes
	for i, x := range f[1:] {
		if i >= 8 { // guest time is counted in user time already
			break
		}
		v, _ := strconv.ParseFloat(x, 64)
		t.total += v
		if i == 3 || i == 4 {
			t.idle += v
		}
	}
	return t
}

// busySince returns the share of the machine's CPU time that was busy
// between then and t (0 to 1; -1 if /proc/stat could not be read).
func (t cpuTimes) busySince(then cpuTimes) float64 {
	d := t.total - then.total
	if d <= 0 || then.total == 0 {
		return -1
	}
	return 1 - (t.idle-then.idle)/d
}

// scaleEtcdStore opens a scale process's etcd client (its requests counted
// by counter) and etcd store, under the setup's prefix, and checks the
// client's connection.
func scaleEtcdStore(spec childSpec, counter *etcdScaleCounter, logger *slog.Logger) (*etcdstore.Store, error) {
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   []string{spec.Etcd},
		DialTimeout: 5 * time.Second,
		DialOptions: counter.dialOptions(),
		Logger:      zap.NewNop(),
	})
	if err != nil {
		return nil, err
	}
	store, err := etcdstore.New(cli, etcdstore.WithPrefix(spec.EtcdPrefix), etcdstore.WithLogger(logger))
	if err != nil {
		cli.Close()
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := cli.Get(ctx, spec.EtcdPrefix+"warm-up"); err != nil {
		store.Close()
		cli.Close()
		return nil, err
	}
	return store, nil
}
