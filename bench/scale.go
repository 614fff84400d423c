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
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/postgres"
)

// The scale measurements of issue 6, on the lease strategy only (the
// advisory strategy holds a server connection per candidate, so it is not
// meant for thousands of names):
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
	name     string // the setup name: lease-scale-10k, lease-scale-100x100
	scenario string
	timing   timing
	names    int // per process
	procs    int
	window   time.Duration
}

func (p plan) scaleRuns() []scaleRun {
	t := timingAt(kindLease, p.scaleTTL)
	return []scaleRun{
		{name: "lease-scale-" + countName(p.scaleNames), scenario: scScaleNames, timing: t,
			names: p.scaleNames, procs: 1, window: p.scaleNamesWindow},
		{name: fmt.Sprintf("lease-scale-%dx%d", p.scaleProcs, p.scaleProcNames), scenario: scScaleProcs, timing: t,
			names: p.scaleProcNames, procs: p.scaleProcs, window: p.scaleProcsWindow},
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

// roundRecorder groups a process's renewals into rounds. The Electors renew
// on a grid of period renew shared by the process (leader's renewEpoch,
// which the bench cannot read): the first Renew call anchors the grid as
// the recorder sees it, and each Renew call and renewal statement belongs
// to the round whose grid point is nearest its start. (A renewal retried
// after a failure, RenewInterval/4 off the grid, joins the nearest round.)
type roundRecorder struct {
	renew time.Duration

	mu     sync.Mutex
	anchor time.Time
	rounds map[int]*roundAgg
	errors int64 // failed Renew calls, in all
}

// seen returns how many rounds have had a Renew call so far.
func (r *roundRecorder) seen() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return int64(len(r.rounds))
}

// roundAgg is one round: its Renew calls (start: when the Elector's timer
// fired; end: when Renew returned) and its renewal statements (the
// tracer's start and end).
type roundAgg struct {
	firstStart, lastStart, lastEnd time.Time
	calls, errors                  int
	stmts                          []stmtSpan
}

type stmtSpan struct {
	start, end time.Time
	failed     bool
}

func newRoundRecorder(renew time.Duration) *roundRecorder {
	return &roundRecorder{renew: renew, rounds: map[int]*roundAgg{}}
}

// round returns t's round; r.mu is held.
func (r *roundRecorder) round(t time.Time) *roundAgg {
	if r.anchor.IsZero() {
		r.anchor = t
	}
	k := int(math.Round(float64(t.Sub(r.anchor)) / float64(r.renew)))
	a := r.rounds[k]
	if a == nil {
		a = &roundAgg{firstStart: t, lastStart: t, lastEnd: t}
		r.rounds[k] = a
	}
	return a
}

func (r *roundRecorder) call(start, end time.Time, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	a := r.round(start)
	a.calls++
	if start.Before(a.firstStart) {
		a.firstStart = start
	}
	if start.After(a.lastStart) {
		a.lastStart = start
	}
	if end.After(a.lastEnd) {
		a.lastEnd = end
	}
	if err != nil {
		a.errors++
		r.errors++
	}
}

func (r *roundRecorder) statement(start, end time.Time, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	a := r.round(start)
	a.stmts = append(a.stmts, stmtSpan{start, end, err != nil})
}

func (r *roundRecorder) failedCalls() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.errors
}

// roundReport is one round of a scale-names process.
type roundReport struct {
	AtS        float64   `json:"at_s"`        // its grid point, after the window began
	Calls      int       `json:"calls"`       // Renew calls (Electors renewed, or tried to)
	Errors     int       `json:"errors"`      // of which failed
	Statements int       `json:"statements"`  // renewal statements sent
	SpreadMs   float64   `json:"spread_ms"`   // first to last Renew call's start: how long the calls took to arrive
	WaitMs     float64   `json:"wait_ms"`     // first call's start to the first statement's start
	LatencyMs  float64   `json:"latency_ms"`  // first call's start to the last call's return: the round
	HandOutMs  float64   `json:"hand_out_ms"` // last statement's end to the last call's return
	StmtMs     []float64 `json:"stmt_ms"`     // each statement, tracer start to end
	StmtFailed int       `json:"stmt_failed"` // statements that returned an error
}

// report returns the rounds whose grid point is in [from, to-renew/2]
// (so that each is whole), in order.
func (r *roundRecorder) report(from, to time.Time) []roundReport {
	r.mu.Lock()
	defer r.mu.Unlock()
	var ks []int
	for k := range r.rounds {
		at := r.anchor.Add(time.Duration(k) * r.renew)
		if !at.Before(from) && !at.After(to.Add(-r.renew/2)) {
			ks = append(ks, k)
		}
	}
	slices.Sort(ks)
	out := make([]roundReport, 0, len(ks))
	for _, k := range ks {
		a := r.rounds[k]
		rr := roundReport{
			AtS:        r.anchor.Add(time.Duration(k) * r.renew).Sub(from).Seconds(),
			Calls:      a.calls,
			Errors:     a.errors,
			Statements: len(a.stmts),
			SpreadMs:   msDur(a.lastStart.Sub(a.firstStart)),
			LatencyMs:  msDur(a.lastEnd.Sub(a.firstStart)),
		}
		var firstStmt, lastStmtEnd time.Time
		for _, s := range a.stmts {
			if firstStmt.IsZero() || s.start.Before(firstStmt) {
				firstStmt = s.start
			}
			if s.end.After(lastStmtEnd) {
				lastStmtEnd = s.end
			}
			rr.StmtMs = append(rr.StmtMs, msDur(s.end.Sub(s.start)))
			if s.failed {
				rr.StmtFailed++
			}
		}
		if !firstStmt.IsZero() {
			rr.WaitMs = msDur(firstStmt.Sub(a.firstStart))
			rr.HandOutMs = msDur(a.lastEnd.Sub(lastStmtEnd))
		}
		out = append(out, rr)
	}
	return out
}

func msDur(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

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

// runScaleNames runs spec.Names Electors, one per name, on one lease store;
// waits until every one leads and reports how long that took ("ready");
// then measures a window from "mark" to "report".
func runScaleNames(spec childSpec, em *emitter, logger *slog.Logger) int {
	n := spec.Names
	rec := newRoundRecorder(spec.Timing.Renew.D())
	tracer := &scaleTracer{onRenew: rec.statement}
	// The pool and store stay open until the process exits: on "exit" it
	// leaves at once, releasing nothing (its database is dropped next).
	store, err := scaleStore(spec, tracer, logger)
	if err != nil {
		return em.fail(err)
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
		markCounts    = tracer.snapshot()
		markDemoted   = demoted.Load()
		markRenewErrs = rec.failedCalls()
	)
	profile, stopProfile := os.Getenv(envCPUProfile), func() {}
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		switch in.Text() {
		case cmdMark:
			markT, markCounts, markDemoted, markRenewErrs = time.Now(), tracer.snapshot(), demoted.Load(), rec.failedCalls()
			if profile != "" {
				if stopProfile, err = startCPUProfile(profile); err != nil {
					return em.fail(err)
				}
			}
		case cmdReport:
			stopProfile()
			now := time.Now()
			c := tracer.snapshot()
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

// runScaleProc is one of the many processes: it opens its pool (few
// connections) and store, says "ready", and on "campaign" runs spec.Names
// Electors, one per name, with a discarding logger. It reports each
// election and demotion with the name, "campaigning" once every Elector
// has made its first attempt, and its counts on "counts".
func runScaleProc(spec childSpec, em *emitter, logger *slog.Logger) int {
	rec := newRoundRecorder(spec.Timing.Renew.D())
	maxStmt, maxCall := &maxMs{}, &maxMs{}
	tracer := &scaleTracer{onRenew: func(start, end time.Time, _ error) { maxStmt.add(end.Sub(start)) }}
	// The pool and store stay open until the process exits: on "exit" it
	// leaves at once, releasing nothing (its database is dropped next).
	store, err := scaleStore(spec, tracer, logger)
	if err != nil {
		return em.fail(err)
	}
	ctx := context.Background()
	em.emit(event{Ev: "ready"})

	var leading, attempted atomic.Int64
	discard := slog.New(slog.DiscardHandler)
	started := false
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		switch in.Text() {
		case cmdCampaign:
			if started {
				continue
			}
			started = true
			for i := range spec.Names {
				name := scaleName(i)
				e, err := leader.New(store, leader.Config{
					Name:          name,
					ID:            spec.ID,
					TTL:           spec.Timing.TTL.D(),
					RenewInterval: spec.Timing.Renew.D(),
					Logger:        discard,
					OnElected: func(context.Context) {
						leading.Add(1)
						em.emit(event{Ev: "elected", Name: name})
					},
					OnDemoted: func() {
						leading.Add(-1)
						em.emit(event{Ev: "demoted", Name: name})
					},
					Metrics: &scaleMetrics{rec: rec, maxRenew: maxCall,
						onLost: func(reason string) { em.emit(event{Ev: "lost", Name: name, Msg: reason}) },
						firstAttempt: func() {
							if attempted.Add(1) == int64(spec.Names) {
								em.emit(event{Ev: "campaigning"})
							}
						}},
				})
				if err != nil {
					return em.fail(err)
				}
				go e.Run(ctx)
			}
		case cmdCounts:
			c := tracer.snapshot()
			c.Leading, c.Rounds = leading.Load(), rec.seen()
			c.MaxRenewStmtMs, c.MaxRenewCallMs = maxStmt.take(), maxCall.take()
			em.emit(event{Ev: "counts", Counts: &c})
		case cmdExit:
			return 0
		}
	}
	return 1
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

// measureScaleNames: one process holds sc.names names (see runScaleNames).
// After every name is led and two renew intervals more, the window runs
// from "mark" to "report"; the server's statement counts are read around
// it, and the leases held at its end are counted on the server.
func (b *bench) measureScaleNames(ctx context.Context, sc scaleRun) (r Result) {
	start := time.Now()
	ttl, renew := sc.timing.TTL.D(), sc.timing.Renew.D()
	r = Result{Scenario: sc.scenario, Setup: sc.name, Kind: kindLease, Timing: sc.timing, Trials: 1}
	defer func() { r.WallSec = time.Since(start).Seconds() }()
	fail := func(err error) Result {
		r.Error = err.Error()
		b.logf("%s: %v", sc.name, err)
		return r
	}
	dbname := "lb_" + dbSafe(sc.name)
	if err := b.db.createDatabase(ctx, dbname, kindLease, []string{scaleRole}); err != nil {
		return fail(err)
	}
	defer b.db.dropDatabase(context.Background(), dbname)
	spec := childSpec{Kind: kindLease, Timing: sc.timing, Name: scaleNamePrefix, ID: "scale", Names: sc.names,
		ConnString: b.db.connString(dbname, scaleRole, "")}
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

	srv1, err := b.db.scaleCounts(ctx, dbname)
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
	srv2, err := b.db.scaleCounts(ctx, dbname)
	if err != nil {
		return fail(err)
	}
	lt, err := b.db.leaseTable(ctx, dbname)
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

// scaleChild is one process of the many-processes measurement.
type scaleChild struct {
	i                  int
	p                  *proc
	ready, campaigning bool
	exited             bool
	countsN            int
	counts             counts
	leads              map[string]int // elected minus demoted, per name
	elected, demoted   int
}

type scaleChildEvent struct {
	c  *scaleChild
	ev event
}

// measureScaleProcs: sc.procs processes each campaign for the same
// sc.names names (see runScaleProc). They connect first, then all start
// campaigning at once, so leadership is spread by the race. After every
// name has a leader, every Elector has made its first attempt, and a TTL
// more, the window counts each process's statements by kind, and every
// election or demotion, which must be none.
func (b *bench) measureScaleProcs(ctx context.Context, sc scaleRun) (r Result) {
	start := time.Now()
	ttl, renew := sc.timing.TTL.D(), sc.timing.Renew.D()
	r = Result{Scenario: sc.scenario, Setup: sc.name, Kind: kindLease, Timing: sc.timing, Trials: 1}
	defer func() { r.WallSec = time.Since(start).Seconds() }()
	fail := func(err error) Result {
		r.Error = err.Error()
		b.logf("%s: %v", sc.name, err)
		return r
	}
	dbname := "lb_" + dbSafe(sc.name)
	if err := b.db.createDatabase(ctx, dbname, kindLease, []string{scaleRole}); err != nil {
		return fail(err)
	}
	defer b.db.dropDatabase(context.Background(), dbname)

	children := make([]*scaleChild, 0, sc.procs)
	events := make(chan scaleChildEvent, 4096)
	defer func() {
		done := make(chan struct{})
		for _, c := range children {
			go func() {
				c.p.stop(15 * time.Second)
				done <- struct{}{}
			}()
		}
		for range children {
			<-done
		}
	}()
	var errs []string
	firstElected := map[string]int64{} // name: when it first had a leader
	type change struct {
		t          int64 // CLOCK_MONOTONIC
		proc       int
		what, name string
	}
	var changeLog []change // every election, loss (with its reason) and demotion
	apply := func(ce scaleChildEvent) {
		c, ev := ce.c, ce.ev
		switch ev.Ev {
		case "elected", "lost", "demoted":
			what := ev.Ev
			if ev.Ev == "lost" {
				what = "lost (" + ev.Msg + ")"
			}
			changeLog = append(changeLog, change{ev.T, c.i, what, ev.Name})
		}
		switch ev.Ev {
		case "ready":
			c.ready = true
		case "campaigning":
			c.campaigning = true
		case "elected":
			c.elected++
			c.leads[ev.Name]++
			if _, ok := firstElected[ev.Name]; !ok {
				firstElected[ev.Name] = ev.T
			}
		case "demoted":
			c.demoted++
			c.leads[ev.Name]--
		case "counts":
			c.countsN++
			if ev.Counts != nil {
				c.counts = *ev.Counts
			}
		case "exit":
			c.exited = true
		case "error":
			errs = append(errs, fmt.Sprintf("p%02d: %s", c.i, ev.Msg))
		}
	}
	waitUntil := func(timeout time.Duration, what string, cond func() bool) error {
		timer := time.NewTimer(timeout)
		defer timer.Stop()
		for {
			for drained := false; !drained; {
				select {
				case ce := <-events:
					apply(ce)
				default:
					drained = true
				}
			}
			if len(errs) > 0 {
				return fmt.Errorf("%s", strings.Join(errs, "; "))
			}
			for _, c := range children {
				if c.exited {
					return fmt.Errorf("process p%02d exited", c.i)
				}
			}
			if cond() {
				return nil
			}
			select {
			case ce := <-events:
				apply(ce)
			case <-timer.C:
				return fmt.Errorf("no %s within %v", what, timeout)
			}
		}
	}
	sleep := func(d time.Duration) { _ = waitUntil(d, "", func() bool { return false }) }
	leadersOf := func() (perName map[string]int) {
		perName = map[string]int{}
		for _, c := range children {
			for name, n := range c.leads {
				if n > 0 {
					perName[name]++
				}
			}
		}
		return perName
	}
	changes := func() (n int) {
		for _, c := range children {
			n += c.elected + c.demoted
		}
		return n
	}
	collect := func() error {
		want := map[*scaleChild]int{}
		for _, c := range children {
			want[c] = c.countsN + 1
			c.p.send(cmdCounts)
		}
		return waitUntil(time.Minute, "statement counts from every process", func() bool {
			for c, n := range want {
				if c.countsN < n {
					return false
				}
			}
			return true
		})
	}

	for i := range sc.procs {
		spec := childSpec{Kind: kindLease, Timing: sc.timing, Name: scaleNamePrefix, ID: fmt.Sprintf("p%02d", i),
			Names: sc.names, PoolConns: scaleProcPoolConns, ConnString: b.db.connString(dbname, scaleRole, "")}
		p, evs, err := b.procs.start(roleScaleProc, spec)
		if err != nil {
			return fail(fmt.Errorf("starting process %d of %d (try fewer with -scale-procs): %w", i+1, sc.procs, err))
		}
		c := &scaleChild{i: i, p: p, leads: map[string]int{}}
		children = append(children, c)
		go func() {
			for ev := range evs {
				events <- scaleChildEvent{c, ev}
			}
			events <- scaleChildEvent{c, event{Ev: "exit"}}
		}()
	}
	if err := waitUntil(3*time.Minute, "connection from every process", func() bool {
		return !slices.ContainsFunc(children, func(c *scaleChild) bool { return !c.ready })
	}); err != nil {
		return fail(err)
	}
	b.logf("  %s: %d processes connected after %.1fs; campaigning", sc.name, sc.procs, time.Since(start).Seconds())
	t0 := monoNow()
	for _, c := range children {
		c.p.send(cmdCampaign)
	}
	if err := waitUntil(3*time.Minute, "leader for every name with every Elector campaigning", func() bool {
		return len(leadersOf()) == sc.names && !slices.ContainsFunc(children, func(c *scaleChild) bool { return !c.campaigning })
	}); err != nil {
		return fail(err)
	}
	var allLed int64
	for _, t := range firstElected {
		allLed = max(allLed, t)
	}
	b.logf("  %s: every name led %.1fs after the campaign began", sc.name, float64(allLed-t0)/1e9)
	// Settle: past every follower's first attempts (each then waits for
	// the expiry it was told), and until leadership has been stable for a
	// TTL (a leader lost in the start-up rush is replaced only at the
	// followers' next attempt), at most settleMax.
	const settleMax = 2 * time.Minute
	settleFrom, settleChanges := monoNow(), changes()
	stable := false
	for monoNow()-settleFrom < int64(settleMax) {
		sleep(time.Second)
		last := settleFrom
		for _, ch := range changeLog {
			last = max(last, ch.t)
		}
		if now := monoNow(); now-settleFrom >= int64(ttl) && now-last >= int64(ttl) {
			stable = true
			break
		}
	}
	describeChanges := func(from, to int64) (lines []string, byReason map[string]int) {
		byReason = map[string]int{}
		for _, ch := range changeLog {
			if ch.t < from || ch.t > to {
				continue
			}
			if reason, ok := strings.CutPrefix(ch.what, "lost "); ok {
				byReason[strings.Trim(reason, "()")]++
			}
			if len(lines) < 20 {
				lines = append(lines, fmt.Sprintf("+%.2fs p%02d %s %s", float64(ch.t-from)/1e9, ch.proc, ch.what, ch.name))
			}
		}
		return lines, byReason
	}
	settled := changes() - settleChanges
	if settled > 0 {
		lines, _ := describeChanges(allLed, monoNow())
		r.Notes = append(r.Notes, fmt.Sprintf("%d leadership changes after every name was led and before the window (the first 20, from the last name's first election): %s",
			settled, strings.Join(lines, "; ")))
		b.logf("  %s: %d leadership changes before the window: %s", sc.name, settled, strings.Join(lines, "; "))
	}
	if !stable {
		r.Notes = append(r.Notes, fmt.Sprintf("leadership was not stable for a TTL within %v of every name being led; the window began anyway", settleMax))
	}
	b.logf("  %s: settled %.1fs after every name was led (%d changes meanwhile); window begins", sc.name, float64(monoNow()-settleFrom)/1e9, settled)

	changes0 := changes()
	if err := collect(); err != nil {
		return fail(err)
	}
	before := make([]counts, len(children))
	var startStmtMax, startCallMax float64
	for i, c := range children {
		before[i] = c.counts
		startStmtMax, startCallMax = max(startStmtMax, c.counts.MaxRenewStmtMs), max(startCallMax, c.counts.MaxRenewCallMs)
	}
	srv1, err := b.db.scaleCounts(ctx, dbname)
	if err != nil {
		return fail(err)
	}
	t1, m1, cpu1 := time.Now(), monoNow(), readCPU()
	b.progressSleep(sc.name, sc.window, sleep)
	if err := collect(); err != nil {
		return fail(err)
	}
	srv2, err := b.db.scaleCounts(ctx, dbname)
	if err != nil {
		return fail(err)
	}
	secs, m2, cpu2 := time.Since(t1).Seconds(), monoNow(), readCPU()
	lt, err := b.db.leaseTable(ctx, dbname)
	if err != nil {
		return fail(err)
	}

	var stmtMax, callMax float64
	for _, c := range children {
		stmtMax, callMax = max(stmtMax, c.counts.MaxRenewStmtMs), max(callMax, c.counts.MaxRenewCallMs)
	}
	rounds, ttls := secs/renew.Seconds(), secs/ttl.Seconds()
	var (
		total, acquires, followerElectors               float64
		perProc, leaderPerRound, followerPerTTL, rssMiB []float64
		leaderPerRoundWindow                            []float64
		extraStmts                                      float64
		leadingProcs, maxLed, splitProcs                int
	)
	for i, c := range children {
		d := counts{
			Statements: c.counts.Statements - before[i].Statements,
			Renewals:   c.counts.Renewals - before[i].Renewals,
			Acquires:   c.counts.Acquires - before[i].Acquires,
			Rounds:     c.counts.Rounds - before[i].Rounds,
		}
		total += float64(d.Statements)
		acquires += float64(d.Acquires)
		perProc = append(perProc, float64(d.Statements)/secs)
		led := int(c.counts.Leading)
		if led > 0 {
			leadingProcs++
			maxLed = max(maxLed, led)
			leaderPerRoundWindow = append(leaderPerRoundWindow, float64(d.Renewals)/rounds)
			if d.Rounds > 0 {
				leaderPerRound = append(leaderPerRound, float64(d.Renewals)/float64(d.Rounds))
			}
			if d.Renewals > d.Rounds {
				extraStmts += float64(d.Renewals - d.Rounds)
				splitProcs++
			}
		}
		if f := sc.names - led; f > 0 {
			followerElectors += float64(f)
			followerPerTTL = append(followerPerTTL, float64(d.Acquires)/float64(f)/ttls)
		}
		if kib, ok := rssKiB(c.p.pid()); ok {
			rssMiB = append(rssMiB, kib/1024)
		}
	}
	perName := leadersOf()
	minLeaders, maxLeaders := math.MaxInt, 0
	for i := range sc.names {
		n := perName[scaleName(i)]
		minLeaders, maxLeaders = min(minLeaders, n), max(maxLeaders, n)
	}
	v := map[string]float64{
		"processes":                       float64(sc.procs),
		"names":                           float64(sc.names),
		"window_s":                        secs,
		"all_led_s":                       float64(allLed-t0) / 1e9,
		"leaders_per_name_min":            float64(minLeaders),
		"leaders_per_name_max":            float64(maxLeaders),
		"changes_before_window":           float64(settled),
		"before_window_renew_stmt_max_ms": startStmtMax,
		"before_window_renew_call_max_ms": startCallMax,
		"renew_stmt_max_ms":               stmtMax,
		"renew_call_max_ms":               callMax,
		"leadership_changes":              float64(changes() - changes0),
		"machine_cpu_busy":                cpu2.busySince(cpu1),
		"server_leases_held":              float64(lt.held),
		"server_lease_holders":            float64(lt.holders),
		"leading_processes":               float64(leadingProcs),
		"names_led_max_per_process":       float64(maxLed),
		"client_stmts_per_s":              total / secs,
		"stmts_per_s_per_process":         total / secs / float64(len(children)),
		"stmts_per_s_per_process_max":     slices.Max(perProc),
	}
	if len(leaderPerRound) > 0 {
		v["leader_stmts_per_round_mean"] = mean(leaderPerRound)
		v["leader_stmts_per_round_max"] = slices.Max(leaderPerRound)
	}
	v["leader_extra_statements"] = extraStmts          // renewal statements beyond one per round
	v["leading_processes_split"] = float64(splitProcs) // processes that sent any
	if len(leaderPerRoundWindow) > 0 {
		v["leader_stmts_per_round_window_mean"] = mean(leaderPerRoundWindow)
	}
	if followerElectors > 0 {
		v["follower_stmts_per_ttl"] = acquires / followerElectors / ttls
		v["follower_stmts_per_ttl_max"] = slices.Max(followerPerTTL)
	}
	if len(rssMiB) > 0 {
		v["process_rss_mib_mean"] = mean(rssMiB)
		v["process_rss_mib_max"] = slices.Max(rssMiB)
	}
	if srv1.ok {
		v["server_stmts_per_s"] = float64(srv2.all-srv1.all) / secs
		v["server_renew_stmts_per_s"] = float64(srv2.renewals-srv1.renewals) / secs
		v["server_acquire_stmts_per_s"] = float64(srv2.acquires-srv1.acquires) / secs
	} else {
		r.Notes = append(r.Notes, "pg_stat_statements is not available on this server: no server counts")
	}
	inWindow, byReason := describeChanges(m1, m2)
	for reason, n := range byReason {
		v["losses_"+reason] = float64(n)
	}
	if len(inWindow) > 0 {
		r.Notes = append(r.Notes, "changes in the window (the first 20, from its start): "+strings.Join(inWindow, "; "))
		b.logf("  %s: changes in the window: %s", sc.name, strings.Join(inWindow, "; "))
	}
	r.Values = v
	r.Notes = append(r.Notes, fmt.Sprintf(
		"%d processes, each with %d Electors (names %s … %s) on one LeaseStore, a pool of %d connections (and the store's listener), a discarding logger; TTL %s, RenewInterval %s; all began campaigning at once",
		sc.procs, sc.names, scaleName(0), scaleName(sc.names-1), scaleProcPoolConns, shortDur(ttl), shortDur(renew)))
	return r
}

func mean(xs []float64) float64 {
	s := 0.0
	for _, x := range xs {
		s += x
	}
	return s / float64(len(xs))
}

// rssKiB reads a process's resident set size.
func rssKiB(pid int) (float64, bool) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			f := strings.Fields(rest)
			if len(f) > 0 {
				v, err := strconv.ParseFloat(f[0], 64)
				return v, err == nil
			}
		}
	}
	return 0, false
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
