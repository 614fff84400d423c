package main

import (
	"context"
	"fmt"
	"slices"
	"time"
)

// Result is one measurement: a scenario on a setup. Every scenario returns
// this shape; latencies go in SamplesMs (summarized in Summary), rates and
// costs in Values.
type Result struct {
	Scenario  string             `json:"scenario"`
	Setup     string             `json:"setup"`
	Kind      string             `json:"kind"`
	Timing    timing             `json:"timing"`
	Defaults  bool               `json:"defaults"`
	Followers int                `json:"followers,omitempty"`
	Trials    int                `json:"trials,omitempty"`
	Failures  int                `json:"failures,omitempty"`
	SamplesMs []float64          `json:"samples_ms,omitempty"`
	Summary   *summary           `json:"summary_ms,omitempty"`
	Values    map[string]float64 `json:"values,omitempty"`
	Notes     []string           `json:"notes,omitempty"`
	// SeriesMs are further latencies of the same trials, by name, every
	// sample (the transfer's command_to_elected).
	SeriesMs map[string][]float64 `json:"series_ms,omitempty"`
	// Rounds are the renew rounds of the scale measurement of one process
	// with many names, each with its statements' latencies.
	Rounds []roundReport `json:"rounds,omitempty"`
	// Deploys are the rolling deploys, one by one.
	Deploys []deployReport `json:"deploys,omitempty"`
	Error   string         `json:"error,omitempty"`
	WallSec float64        `json:"wall_s"`
}

// groupScenario measures something on a running group of candidates.
type groupScenario struct {
	name string
	run  func(g *group, r *Result) error
}

// groupScenarios are run in the order of a setup's Scenarios. New
// scenarios (many names per process, many processes, many followers at
// release) add an entry here, or a standalone function like measureIdle.
var groupScenarios = map[string]groupScenario{
	scLoad:      {scLoad, measureLoad},
	scGraceful:  {scGraceful, measureGraceful},
	scTransfer:  {scTransfer, measureTransfer},
	scCrash:     {scCrash, measureCrash},
	scBlackHole: {scBlackHole, measureBlackHole},
	scRolling:   {scRolling, measureRollingDeploy},
}

func ms(ns int64) float64 { return float64(ns) / 1e6 }

// maxFailures is how many failed trials end a scenario early.
const maxFailures = 3

// trialLoop runs trial n times, stopping after maxFailures failures.
func trialLoop(g *group, r *Result, n int, trial func() (float64, error)) error {
	r.Trials = n
	for i := range n {
		sample, err := trial()
		if err != nil {
			r.Failures++
			r.Notes = append(r.Notes, fmt.Sprintf("trial %d: %v", i, err))
			g.b.logf("%s %s trial %d failed: %v", g.s.Name, r.Scenario, i, err)
			if r.Failures >= maxFailures {
				r.Trials = i + 1
				return fmt.Errorf("%d trials failed", r.Failures)
			}
			continue
		}
		r.SamplesMs = append(r.SamplesMs, sample)
		if (i+1)%max(n/4, 1) == 0 {
			g.b.logf("  %s %s: %d/%d trials", g.s.Name, r.Scenario, i+1, n)
		}
	}
	return nil
}

// measureGraceful: after a random wait (up to a renew interval, at most a
// second), the leader process is told to stop (on its standard input); it stops campaigning the way its kind does on shutdown (ours:
// Run's context ends, which releases; skill: stop(), which deletes the
// row; client-go: the context of Run ends with ReleaseOnCancel; etcd:
// Resign). The figure is from the moment the leader read the command to
// the moment another process's OnElected (or equivalent) ran, both on
// CLOCK_MONOTONIC. The stopped process then campaigns again as a
// follower, so the group keeps its size.
func measureGraceful(g *group, r *Result) error {
	return trialLoop(g, r, g.s.GracefulTrials, func() (float64, error) {
		l, err := g.waitLeader()
		if err != nil {
			return 0, err
		}
		g.shortPhase()
		stopping, stopped, ready := l.stopping, l.stopped, l.ready
		l.p.send(cmdStop)
		if err := g.waitUntil(30*time.Second, l.id+" stopping", func() bool { return l.stopping > stopping }); err != nil {
			return 0, err
		}
		var next *member
		errElect := g.waitUntil(g.takeoverTimeout(), "successor", func() bool {
			next = g.electedAfter(l.lastStoppingT, l)
			return next != nil
		})
		errStop := g.waitUntil(30*time.Second, l.id+" stopped", func() bool { return l.stopped > stopped })
		l.p.send(cmdResume)
		errResume := g.waitUntil(time.Minute, l.id+" campaigning again", func() bool { return l.ready > ready })
		switch {
		case errElect != nil:
			return 0, errElect
		case errStop != nil:
			return 0, errStop
		case errResume != nil:
			return 0, errResume
		}
		return ms(next.lastElectedT - l.lastStoppingT), nil
	})
}

// measureCrash: the leader process is killed with SIGKILL (it releases
// nothing; the kernel closes its sockets). The figure is from just before
// kill(2) to another process's OnElected. A new process then takes the
// killed one's slot.
func measureCrash(g *group, r *Result) error {
	return trialLoop(g, r, g.s.CrashTrials, func() (float64, error) {
		l, err := g.waitLeader()
		if err != nil {
			return 0, err
		}
		g.phase()
		t0 := monoNow()
		l.p.kill()
		var next *member
		errElect := g.waitUntil(g.takeoverTimeout(), "successor", func() bool {
			next = g.electedAfter(t0, l)
			return next != nil
		})
		if err := g.replace(l); err != nil {
			return 0, err
		}
		if errElect != nil {
			return 0, errElect
		}
		return ms(next.lastElectedT - t0), nil
	})
}

// measureBlackHole: the leader's proxy starts dropping every byte both
// ways and never closes a connection, as when its host vanishes from the
// network. The figure is from just before the fault to another process's
// OnElected. The black-holed process lives on (it is not killed until its
// successor is elected), so it also tells when it stepped down: a
// successor elected before that is counted as an overlap.
func measureBlackHole(g *group, r *Result) error {
	overlaps := 0
	var stepDownLead []float64 // how long before the successor the old leader stepped down
	err := trialLoop(g, r, g.s.CrashTrials, func() (float64, error) {
		l, err := g.waitLeader()
		if err != nil {
			return 0, err
		}
		g.phase()
		t0 := monoNow()
		if err := g.blackHole(l); err != nil {
			return 0, err
		}
		var next *member
		errElect := g.waitUntil(g.takeoverTimeout(), "successor", func() bool {
			next = g.electedAfter(t0, l)
			return next != nil
		})
		if errElect == nil {
			// Its demotion may still be on its way through the pipe.
			_ = g.waitUntil(g.s.Timing.TTL.D(), l.id+" stepping down", func() bool { return !l.leader })
			if l.leader || l.lastDemotedT > next.lastElectedT {
				overlaps++
			} else {
				stepDownLead = append(stepDownLead, ms(next.lastElectedT-l.lastDemotedT))
			}
		}
		if err := g.replace(l); err != nil {
			return 0, err
		}
		if errElect != nil {
			return 0, errElect
		}
		return ms(next.lastElectedT - t0), nil
	})
	r.Values = map[string]float64{"overlaps": float64(overlaps)}
	if len(stepDownLead) > 0 {
		r.Values["old_leader_stepped_down_before_successor_min_ms"] = slices.Min(stepDownLead)
	}
	return err
}

// measureLoad counts what each candidate sends at steady state over a
// window: on the client (the pgx tracer or the gRPC interceptors of each
// process) and on the server (pg_stat_statements per role, one role per
// slot; pg_stat_database's transactions; etcd's own gRPC metrics). The
// window starts two renew intervals (at least 2s, at most a TTL) after
// the group is settled and must see no election.
func measureLoad(g *group, r *Result) error {
	ctx := context.Background()
	ttl, renew := g.s.Timing.TTL.D(), g.s.Timing.Renew.D()
	if _, err := g.waitLeader(); err != nil {
		return err
	}
	g.sleep(min(max(2*renew, 2*time.Second), ttl)) // past every follower's first attempts
	l, err := g.waitLeader()
	if err != nil {
		return err
	}
	elections := func() (n int) {
		for _, m := range g.members {
			n += m.elected
		}
		return n
	}
	electionsBefore := elections()

	snapshot := func() (srv serverCounts, etcdMsgs int64, err error) {
		if err := g.collectCounts(); err != nil {
			return srv, 0, err
		}
		if usesEtcd(g.s.Kind) {
			etcdMsgs, err = g.b.etcd.requestsReceived()
			return srv, etcdMsgs, err
		}
		srv, err = g.b.db.serverCounts(ctx, g.dbname)
		return srv, 0, err
	}
	members := g.live()
	srv1, etcd1, err := snapshot()
	if err != nil {
		return err
	}
	before := map[*member]counts{}
	for _, m := range members {
		before[m] = m.counts
	}
	t1 := time.Now()
	g.sleep(g.s.LoadWindow.D())
	srv2, etcd2, err := snapshot()
	if err != nil {
		return err
	}
	window := time.Since(t1)
	if elections() != electionsBefore || !l.leader || l.exited {
		return fmt.Errorf("leadership changed during the load window")
	}
	secs := window.Seconds()
	v := map[string]float64{"window_s": secs}
	var followerStmts, followerConnects []float64
	var clientTotal float64
	for _, m := range members {
		d := float64(m.counts.Statements - before[m].Statements)
		clientTotal += d
		if m == l {
			v["leader_stmts_per_s"] = d / secs
			v["leader_stmts_per_renew"] = d / (secs / renew.Seconds())
			v["leader_connects"] = float64(m.counts.Connects - before[m].Connects)
			continue
		}
		followerStmts = append(followerStmts, d)
		followerConnects = append(followerConnects, float64(m.counts.Connects-before[m].Connects))
	}
	if n := float64(len(followerStmts)); n > 0 {
		sum := 0.0
		for _, d := range followerStmts {
			sum += d
		}
		v["follower_stmts_per_s"] = sum / n / secs
		v["follower_stmts_per_s_max"] = slices.Max(followerStmts) / secs
		v["follower_stmts_per_ttl"] = sum / n / (secs / ttl.Seconds())
		cs := 0.0
		for _, c := range followerConnects {
			cs += c
		}
		v["follower_connects"] = cs / n
	}
	v["client_stmts_per_s"] = clientTotal / secs
	if usesEtcd(g.s.Kind) {
		v["server_requests_per_s"] = float64(etcd2-etcd1) / secs
		r.Notes = append(r.Notes, "server side: etcd's grpc_server_msg_received_total (all clients of the embedded server)")
		if g.s.Kind == kindLeaderEtcd {
			r.Notes = append(r.Notes, "the etcd store opens a stream for each keep-alive (connects: streams opened); "+
				"the server also counts the end of each stream a client closes as a message received, which the client does not send")
		}
	} else {
		if srv1.Statements != nil {
			var serverTotal, followerSum float64
			for role, n := range srv2.Statements {
				serverTotal += float64(n - srv1.Statements[role])
			}
			for _, m := range members {
				d := float64(srv2.Statements[m.role] - srv1.Statements[m.role])
				if m == l {
					v["server_leader_stmts_per_s"] = d / secs
				} else {
					followerSum += d
				}
			}
			v["server_stmts_per_s"] = serverTotal / secs
			if n := float64(len(followerStmts)); n > 0 {
				v["server_follower_stmts_per_s"] = followerSum / n / secs
			}
		} else {
			r.Notes = append(r.Notes, "pg_stat_statements is not available on this server: no per-role server counts")
		}
		v["server_xacts_per_s"] = float64(srv2.Transactions-srv1.Transactions) / secs
		var conns float64
		for _, m := range members {
			conns += float64(srv2.Connections[m.role])
		}
		v["server_connections"] = conns
	}
	r.Values = v
	return nil
}
