package main

import (
	"bufio"
	"context"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"sync"
	"time"
)

// The herd scenario: many followers of one name, all woken by one release.
// How many acquire attempts does a handover cost, and how long until one
// of them leads? The followers run in one process (each an Elector of its
// own on the process's one store), so one NOTIFY reaches them all through
// one listener; with a process each, every process would get its own
// NOTIFY, and the attempts would be as many.

const (
	roleHerd    = "herd"
	cmdHandover = "handover"
	scHerd      = "release-herd"
	// herdSettle is how long after the successor's election the herd's
	// statements are still counted as the handover's.
	herdSettle = 200 * time.Millisecond
)

// herdTiming is the herd's timing: a long TTL, so that the followers'
// periodic attempts (one per follower about every 0.83 TTL) seldom fall
// into a handover's count.
func herdTiming(kind string) timing { return timingAt(kind, time.Minute) }

// herdReport is one handover in a herd.
type herdReport struct {
	ElectMs    float64 `json:"elect_ms"`   // from the leader's stop to the successor's OnElected
	Acquires   int64   `json:"acquires"`   // Acquire calls, from the stop until herdSettle after the election
	Statements int64   `json:"statements"` // statements sent meanwhile (the release, the attempts, any renewal)
}

type herdElected struct {
	slot int
	t    int64
}

// runHerd runs spec.IdleN+1 candidates of one name in this process. On
// "handover" it stops the leader (which releases), waits for another to be
// elected, reports, and starts the stopped one again as a follower.
func runHerd(spec childSpec, em *emitter, logger *slog.Logger) int {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	be, err := newBackend(ctx, spec, logger)
	cancel()
	if err != nil {
		return em.fail(err)
	}
	defer be.close()
	if be.acquires == nil {
		return em.fail(fmt.Errorf("the herd runs only on our stores, not %s", spec.Kind))
	}
	n := spec.IdleN + 1
	elected := make(chan herdElected, 4*n)
	ready := make([]chan struct{}, n)
	cands := make([]candidate, n)
	var mu sync.Mutex
	leading := make([]bool, n)
	campaign := func(i int) error {
		ch := make(chan struct{})
		ready[i] = ch
		var once sync.Once
		c, err := be.newCandidate(fmt.Sprintf("%s-%d", spec.ID, i), hooks{
			ready: func() { once.Do(func() { close(ch) }) },
			elected: func(uint64, string) {
				t := monoNow()
				mu.Lock()
				leading[i] = true
				mu.Unlock()
				elected <- herdElected{i, t}
			},
			demoted: func() {
				mu.Lock()
				leading[i] = false
				mu.Unlock()
			},
		})
		if err != nil {
			return err
		}
		cands[i] = c
		c.start()
		return nil
	}
	for i := range n {
		if err := campaign(i); err != nil {
			return em.fail(err)
		}
	}
	waitReady := func(i int) error {
		select {
		case <-ready[i]:
			return nil
		case <-time.After(3 * time.Minute):
			return fmt.Errorf("candidate %d made no attempt in 3 minutes", i)
		}
	}
	for i := range n {
		if err := waitReady(i); err != nil {
			return em.fail(err)
		}
	}
	leader := -1
	select {
	case e := <-elected:
		leader = e.slot
	case <-time.After(time.Minute):
		return em.fail(fmt.Errorf("no leader among %d candidates in a minute", n))
	}
	em.emit(event{Ev: "ready"})

	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		switch in.Text() {
		case cmdHandover:
			for drained := false; !drained; {
				select {
				case <-elected:
				default:
					drained = true
				}
			}
			c0, a0 := be.counts(), be.acquires()
			t0 := monoNow()
			stopped := make(chan struct{})
			go func() {
				cands[leader].stop()
				close(stopped)
			}()
			var next herdElected
			found := false
			timeout := time.After(time.Minute)
			for !found {
				select {
				case e := <-elected:
					if e.slot != leader {
						next, found = e, true
					}
				case <-timeout:
					return em.fail(fmt.Errorf("no successor within a minute of stopping candidate %d", leader))
				}
			}
			<-stopped
			time.Sleep(herdSettle)
			c1, a1 := be.counts(), be.acquires()
			if err := campaign(leader); err != nil {
				return em.fail(err)
			}
			if err := waitReady(leader); err != nil {
				return em.fail(err)
			}
			em.emit(event{Ev: "handover", Herd: &herdReport{
				ElectMs:    ms(next.t - t0),
				Acquires:   a1 - a0,
				Statements: c1.Statements - c0.Statements,
			}})
			leader = next.slot
		case cmdExit:
			return 0
		}
	}
	return 1
}

// measureHerd runs trials handovers in a herd of n followers.
func (b *bench) measureHerd(kind string, n, trials int) (r Result) {
	start := time.Now()
	t := herdTiming(kind)
	name := fmt.Sprintf("%s-herd", kind)
	r = Result{Scenario: scHerd, Setup: name, Kind: kind, Timing: t, Followers: n, Trials: trials}
	defer func() { r.WallSec = time.Since(start).Seconds() }()
	fail := func(err error) Result {
		r.Error = err.Error()
		b.logf("%s: %v", name, err)
		return r
	}
	ctx := context.Background()
	dbname := "lb_" + dbSafe(name)
	if err := b.db.createDatabase(ctx, dbname, kind, []string{idleRole}); err != nil {
		return fail(err)
	}
	defer b.db.dropDatabase(context.Background(), dbname)
	spec := childSpec{Kind: kind, Timing: t, Name: electionName, ID: "herd", IdleN: n,
		ConnString: b.db.connString(dbname, idleRole, "")}
	p, events, err := b.procs.start(roleHerd, spec)
	if err != nil {
		return fail(err)
	}
	defer p.stop(15 * time.Second)
	next := func(want string, timeout time.Duration) (event, error) {
		deadline := time.After(timeout)
		for {
			select {
			case ev, ok := <-events:
				if !ok {
					return ev, fmt.Errorf("the herd process exited")
				}
				if ev.Ev == "error" {
					return ev, fmt.Errorf("herd process: %s", ev.Msg)
				}
				if ev.Ev == want {
					return ev, nil
				}
			case <-deadline:
				return event{}, fmt.Errorf("no %q from the herd process within %v", want, timeout)
			}
		}
	}
	if _, err := next("ready", 5*time.Minute); err != nil {
		return fail(err)
	}
	var acquires, statements []float64
	for i := range trials {
		time.Sleep(herdSettle) // let the restarted follower's first attempt pass
		p.send(cmdHandover)
		ev, err := next("handover", 3*time.Minute)
		if err != nil {
			r.Trials = i
			return fail(err)
		}
		r.SamplesMs = append(r.SamplesMs, ev.Herd.ElectMs)
		acquires = append(acquires, float64(ev.Herd.Acquires))
		statements = append(statements, float64(ev.Herd.Statements))
	}
	mean := func(xs []float64) float64 {
		s := 0.0
		for _, x := range xs {
			s += x
		}
		return s / float64(len(xs))
	}
	r.Values = map[string]float64{
		"acquires_per_handover_mean":   mean(acquires),
		"acquires_per_handover_max":    slices.Max(acquires),
		"statements_per_handover_mean": mean(statements),
	}
	r.Notes = append(r.Notes, fmt.Sprintf("%d followers in one process on one store; counted from the leader's stop until %v after the successor's election", n, herdSettle))
	return r
}
