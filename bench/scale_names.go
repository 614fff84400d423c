package main

import (
	"bufio"
	"context"
	"fmt"
	"log/slog"
	"math"
	"os"
	"runtime"
	"runtime/pprof"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leaderelect/leader"
)

// scaleReport is what a scale-names process reports: at "ready" (every name
// led) its start-up, at "report" its window.
type scaleReport struct {
	Names         int              `json:"names"`
	LeadAllMs     float64          `json:"lead_all_ms,omitempty"` // from the first Elector's start until all led
	StartupLosses int64            `json:"startup_losses"`        // OnDemoted calls before all led
	LossReasons   map[string]int64 `json:"loss_reasons,omitempty"`

	WindowS      float64       `json:"window_s,omitempty"`
	Rounds       []roundReport `json:"rounds,omitempty"`
	Counts       counts        `json:"counts"`        // sent in the window
	Losses       int64         `json:"losses"`        // OnDemoted calls in the window
	LossesSettle int64         `json:"losses_settle"` // between "ready" and the window
	Leading      int64         `json:"leading"`       // Electors leading at the report
	RenewErrors  int64         `json:"renew_errors"`  // failed Renew calls in the window
	HeapInuse    uint64        `json:"heap_inuse_bytes,omitempty"`
	Goroutines   int           `json:"goroutines,omitempty"`
}

// runScaleNames runs spec.Names Electors, one per name, on one lease store
// (or, for kindLeaderEtcd, one etcd store);
// waits until every one leads and reports how long that took ("ready");
// then measures a window from "mark" to "report".
func runScaleNames(spec childSpec, em *emitter, logger *slog.Logger) int {
	n := spec.Names
	rec := newRoundRecorder(spec.Timing.Renew.D())
	// The pool (or client) and store stay open until the process exits:
	// on "exit" it leaves at once, releasing nothing (its database is
	// dropped next; on etcd, its setup's keys are left to their leases).
	// On the etcd store a round's renewal "statement" is its keep-alive.
	var (
		store    leader.Store
		snapshot func() counts
		err      error
	)
	if spec.Kind == kindLeaderEtcd {
		counter := &etcdScaleCounter{onKeepAlive: rec.statement}
		s, err := scaleEtcdStore(spec, counter, logger)
		if err != nil {
			return em.fail(err)
		}
		store, snapshot = s, counter.snapshot
	} else {
		tracer := &scaleTracer{onRenew: rec.statement}
		s, err := scaleStore(spec, tracer, logger)
		if err != nil {
			return em.fail(err)
		}
		store, snapshot = s, tracer.snapshot
	}
	ctx := context.Background()

	var leading, demoted atomic.Int64
	losses := &lossCounter{}
	allLead := make(chan struct{})
	var allOnce sync.Once
	start := time.Now()
	for i := range n {
		e, err := leader.New(store, leader.Config{
			Name:          scaleName(i),
			ID:            spec.ID,
			TTL:           spec.Timing.TTL.D(),
			RenewInterval: spec.Timing.Renew.D(),
			Logger:        logger, // warnings and errors only, to the children's log
			OnElected: func(context.Context) {
				if leading.Add(1) == int64(n) {
					allOnce.Do(func() { close(allLead) })
				}
			},
			OnDemoted: func() {
				leading.Add(-1)
				demoted.Add(1)
			},
			Metrics: &scaleMetrics{rec: rec, losses: losses},
		})
		if err != nil {
			return em.fail(err)
		}
		go e.Run(ctx)
	}
	select {
	case <-allLead:
	case <-time.After(5 * time.Minute):
		return em.fail(fmt.Errorf("only %d of %d names led after 5 minutes (%d demotions; losses %v)",
			leading.Load(), n, demoted.Load(), losses.snapshot()))
	}
	readyDemoted := demoted.Load()
	em.emit(event{Ev: "ready", Scale: &scaleReport{
		Names: n, LeadAllMs: msDur(time.Since(start)), StartupLosses: readyDemoted, LossReasons: losses.snapshot(),
	}})

	var (
		markT         = time.Now()
		markCounts    = snapshot()
		markDemoted   = demoted.Load()
		markRenewErrs = rec.failedCalls()
	)
	profile, stopProfile := os.Getenv(envCPUProfile), func() {}
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		switch in.Text() {
		case cmdMark:
			markT, markCounts, markDemoted, markRenewErrs = time.Now(), snapshot(), demoted.Load(), rec.failedCalls()
			if profile != "" {
				if stopProfile, err = startCPUProfile(profile); err != nil {
					return em.fail(err)
				}
			}
		case cmdReport:
			stopProfile()
			now := time.Now()
			c := snapshot()
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			em.emit(event{Ev: "scale", Scale: &scaleReport{
				Names:   n,
				WindowS: now.Sub(markT).Seconds(),
				Rounds:  rec.report(markT, now),
				Counts: counts{
					Statements: c.Statements - markCounts.Statements,
					Connects:   c.Connects - markCounts.Connects,
					Renewals:   c.Renewals - markCounts.Renewals,
					Acquires:   c.Acquires - markCounts.Acquires,
					Releases:   c.Releases - markCounts.Releases,
				},
				Losses:       demoted.Load() - markDemoted,
				LossesSettle: markDemoted - readyDemoted,
				LossReasons:  losses.snapshot(),
				Leading:      leading.Load(),
				RenewErrors:  rec.failedCalls() - markRenewErrs,
				HeapInuse:    ms.HeapInuse,
				Goroutines:   runtime.NumGoroutine(),
			}})
		case cmdExit:
			return 0
		}
	}
	return 1
}

// envCPUProfile names a file to which the scale-names process writes a CPU
// profile of its measured window (a profiling aid, not part of the table).
const envCPUProfile = "LEADERBENCH_CPUPROFILE"

// startCPUProfile starts a CPU profile into the file path, and returns
// what stops it.
func startCPUProfile(path string) (stop func(), err error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", envCPUProfile, err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("%s: %w", envCPUProfile, err)
	}
	return func() {
		pprof.StopCPUProfile()
		f.Close()
	}, nil
}

// measureScaleNames: one process holds sc.names names (see runScaleNames).
// After every name is led and two renew intervals more, the window runs
// from "mark" to "report"; the server's statement counts are read around
// it, and the leases held at its end are counted on the server.
func (b *bench) measureScaleNames(ctx context.Context, sc scaleRun) (r Result) {
	start := time.Now()
	ttl, renew := sc.timing.TTL.D(), sc.timing.Renew.D()
	r = Result{Scenario: sc.scenario, Setup: sc.name, Kind: sc.kind, Timing: sc.timing, Trials: 1}
	defer func() { r.WallSec = time.Since(start).Seconds() }()
	fail := func(err error) Result {
		r.Error = err.Error()
		b.logf("%s: %v", sc.name, err)
		return r
	}
	onEtcd := sc.kind == kindLeaderEtcd
	spec := childSpec{Kind: sc.kind, Timing: sc.timing, Name: scaleNamePrefix, ID: "scale", Names: sc.names}
	dbname := "lb_" + dbSafe(sc.name)
	if onEtcd {
		spec.Etcd, spec.EtcdPrefix = b.etcd.url, leaderEtcdPrefix(sc.name)
	} else {
		if err := b.db.createDatabase(ctx, dbname, kindLease, []string{scaleRole}); err != nil {
			return fail(err)
		}
		defer b.db.dropDatabase(context.Background(), dbname)
		spec.ConnString = b.db.connString(dbname, scaleRole, "")
	}
	// The server's counts: pg_stat_statements, or etcd's requests received
	// (all its clients: the process is the only one meanwhile).
	serverCounts := func() (scaleServer, int64, error) {
		if onEtcd {
			n, err := b.etcd.requestsReceived()
			return scaleServer{}, n, err
		}
		srv, err := b.db.scaleCounts(ctx, dbname)
		return srv, 0, err
	}
	p, events, err := b.procs.start(roleScaleNames, spec)
	if err != nil {
		return fail(err)
	}
	defer p.stop(15 * time.Second)
	ev, err := nextEvent(events, "scale", "ready", 6*time.Minute)
	if err != nil {
		return fail(err)
	}
	ready := ev.Scale
	b.logf("  %s: all %d names led %.1fs after the first Elector started (%d lost meanwhile)",
		sc.name, ready.Names, ready.LeadAllMs/1000, ready.StartupLosses)
	// Settle: each Elector's first renewal comes at most a renew interval
	// after its grant, on the grid; from then on every round is whole.
	time.Sleep(2 * renew)

	srv1, etcd1, err := serverCounts()
	if err != nil {
		return fail(err)
	}
	cpu1 := readCPU()
	p.send(cmdMark)
	b.progressSleep(sc.name, sc.window, time.Sleep)
	p.send(cmdReport)
	cpu2 := readCPU()
	ev, err = nextEvent(events, "scale", "scale", 2*time.Minute)
	if err != nil {
		return fail(err)
	}
	srv2, etcd2, err := serverCounts()
	if err != nil {
		return fail(err)
	}
	var lt leaseTable
	if onEtcd {
		lt.held, err = b.etcd.holderKeys(ctx, spec.EtcdPrefix)
	} else {
		lt, err = b.db.leaseTable(ctx, dbname)
	}
	if err != nil {
		return fail(err)
	}
	rep := ev.Scale
	secs := rep.WindowS
	rounds := secs / renew.Seconds()
	v := map[string]float64{
		"names":                       float64(rep.Names),
		"machine_cpu_busy":            cpu2.busySince(cpu1),
		"lead_all_s":                  ready.LeadAllMs / 1000,
		"startup_losses":              float64(ready.StartupLosses),
		"window_s":                    secs,
		"rounds":                      rounds,
		"renew_statements":            float64(rep.Counts.Renewals),
		"statements_per_round_window": float64(rep.Counts.Renewals) / rounds,
		"losses":                      float64(rep.Losses),
		"losses_before_window":        float64(rep.LossesSettle),
		"leaders_at_end":              float64(rep.Leading),
		"renew_errors":                float64(rep.RenewErrors),
		"client_stmts_per_s":          float64(rep.Counts.Statements) / secs,
		"client_other_stmts":          float64(rep.Counts.Statements - rep.Counts.Renewals),
		"connects":                    float64(rep.Counts.Connects),
		"server_leases_held":          float64(lt.held),
		"server_lease_holders":        float64(lt.holders),
		"server_table_mib":            float64(lt.totalBytes) / (1 << 20),
		"server_dead_tuples":          float64(lt.deadTuples),
		"heap_inuse_mib":              float64(rep.HeapInuse) / (1 << 20),
		"goroutines_per_elector":      float64(rep.Goroutines) / float64(rep.Names),
	}
	var stmtMs, spreadMs, waitMs, handOutMs []float64
	split, short, maxStmts, minCalls, roundStmts := 0, 0, 0, math.MaxInt, 0
	for _, rr := range rep.Rounds {
		roundStmts += rr.Statements
		r.SamplesMs = append(r.SamplesMs, rr.LatencyMs)
		stmtMs = append(stmtMs, rr.StmtMs...)
		spreadMs = append(spreadMs, rr.SpreadMs)
		if rr.Statements > 0 {
			waitMs = append(waitMs, rr.WaitMs)
			handOutMs = append(handOutMs, rr.HandOutMs)
		}
		if rr.Statements > 1 {
			split++
		}
		if rr.Calls < rep.Names {
			short++
		}
		maxStmts = max(maxStmts, rr.Statements)
		minCalls = min(minCalls, rr.Calls)
	}
	v["rounds_observed"] = float64(len(rep.Rounds))
	if len(rep.Rounds) > 0 {
		v["statements_per_round"] = float64(roundStmts) / float64(len(rep.Rounds))
	}
	v["rounds_split"] = float64(split)
	v["rounds_short"] = float64(short)
	v["round_statements_max"] = float64(maxStmts)
	if len(rep.Rounds) > 0 {
		v["round_calls_min"] = float64(minCalls)
		sp := summarize(spreadMs)
		v["round_spread_p50_ms"], v["round_spread_p99_ms"], v["round_spread_max_ms"] = sp.P50, sp.P99, sp.Max
	}
	if len(waitMs) > 0 {
		w := summarize(waitMs)
		v["round_wait_p50_ms"], v["round_wait_p99_ms"], v["round_wait_max_ms"] = w.P50, w.P99, w.Max
		h := summarize(handOutMs)
		v["round_hand_out_p50_ms"], v["round_hand_out_p99_ms"], v["round_hand_out_max_ms"] = h.P50, h.P99, h.Max
	}
	if len(stmtMs) > 0 {
		s := summarize(stmtMs)
		v["stmt_p50_ms"], v["stmt_p99_ms"], v["stmt_max_ms"] = s.P50, s.P99, s.Max
	}
	if lt.updates > 0 {
		v["server_hot_update_ratio"] = float64(lt.hotUpdates) / float64(lt.updates)
	}
	if onEtcd {
		// Besides each round's keep-alive, its read of the names held
		// (and of pending requests to hand over): every request of the
		// window per round.
		v["requests_per_round_window"] = float64(rep.Counts.Statements) / rounds
		v["server_stmts_per_s"] = float64(etcd2-etcd1) / secs
		for _, k := range []string{"server_lease_holders", "server_table_mib", "server_dead_tuples"} {
			delete(v, k)
		}
		r.Values = v
		r.Rounds = rep.Rounds
		r.Notes = append(r.Notes,
			fmt.Sprintf("one process, %d Electors (names %s … %s) on one etcd Store (one client) on the embedded etcd, keys under %s; TTL %s, RenewInterval %s (etcd lease %ds)",
				rep.Names, scaleName(0), scaleName(rep.Names-1), spec.EtcdPrefix, shortDur(ttl), shortDur(renew), etcdLeaseSeconds(ttl)),
			"renewal statements are the Store's lease keep-alives (one stream, one message each); round latency: from the first Elector's renewal timer firing to the last Elector's Renew returning; statement latency: a keep-alive's stream opening to its answer",
			"server: etcd's grpc_server_msg_received_total, which also counts each closed stream's end; leases held: the names' holder keys on etcd at the end")
		if len(rep.LossReasons) > 0 {
			r.Notes = append(r.Notes, fmt.Sprintf("losses by reason since the process started: %v", rep.LossReasons))
		}
		return r
	}
	if srv1.ok {
		renewals := float64(srv2.renewals - srv1.renewals)
		v["server_stmts_per_s"] = float64(srv2.all-srv1.all) / secs
		v["server_renew_statements"] = renewals
		v["server_statements_per_round"] = renewals / rounds
		if renewals > 0 {
			v["server_renew_mean_ms"] = (srv2.renewMs - srv1.renewMs) / renewals
		}
	} else {
		r.Notes = append(r.Notes, "pg_stat_statements is not available on this server: no server counts")
	}
	r.Values = v
	r.Rounds = rep.Rounds
	r.Notes = append(r.Notes,
		fmt.Sprintf("one process, %d Electors (names %s … %s) on one LeaseStore, pgxpool's default pool size; TTL %s, RenewInterval %s",
			rep.Names, scaleName(0), scaleName(rep.Names-1), shortDur(ttl), shortDur(renew)),
		"round latency: from the first Elector's renewal timer firing to the last Elector's Renew returning; statement latency: the pgx tracer's start to end of each UPDATE ... FROM unnest(...)")
	if len(rep.LossReasons) > 0 {
		r.Notes = append(r.Notes, fmt.Sprintf("losses by reason since the process started: %v", rep.LossReasons))
	}
	return r
}
