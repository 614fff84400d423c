package main

import (
	"bufio"
	"context"
	"fmt"
	"log/slog"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/leaderelect/leader"
)

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
