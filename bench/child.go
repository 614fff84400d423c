package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/monotime"
)

// The bench binary runs itself as a child process, one per candidate (and
// one for each idle-cost measurement), when envRole is set. The parent
// passes the childSpec as JSON in envSpec.
const (
	envRole = "LEADERBENCH_CHILD"
	envSpec = "LEADERBENCH_SPEC"

	roleCandidate = "candidate"
	roleIdle      = "idle"
	// roleScaleNames and roleScaleProc: see scale_names.go and scale_procs.go.
	roleScaleNames = "scale-names"
	roleScaleProc  = "scale-proc"
)

// childSpec tells a child what to run.
type childSpec struct {
	Kind       string `json:"kind"`
	Timing     timing `json:"timing"`
	ConnString string `json:"conn_string,omitempty"` // PostgreSQL kinds
	Etcd       string `json:"etcd,omitempty"`        // etcd kinds: client URL
	EtcdPrefix string `json:"etcd_prefix,omitempty"` // leader-etcd: the store's key prefix
	Name       string `json:"name"`                  // the election
	ID         string `json:"id"`                    // candidate ID (idle: prefix)
	IdleN      int    `json:"idle_n,omitempty"`      // idle: how many followers
	// StartDelay is how long a candidate waits before its first campaign.
	StartDelay duration `json:"start_delay,omitempty"`
	// Names is how many names a scale process campaigns for, named
	// Name-00000 on; PoolConns its pool's MaxConns (0: pgxpool's default).
	Names     int `json:"names,omitempty"`
	PoolConns int `json:"pool_conns,omitempty"`
	// Priority is a candidate's Config.Priority, and HandOverOnStop its
	// Config.HandOverOnStop (ours only): the rolling deploy starts each
	// new release one above the last, and stops the old one as "leader
	// run" does at SIGTERM.
	Priority       int  `json:"priority,omitempty"`
	HandOverOnStop bool `json:"hand_over_on_stop,omitempty"`
}

// event is one line a child writes on its standard output.
//
//	ready     a campaign has made its first attempt (it is a follower or the leader)
//	enlisted  ours: the campaign's first Enlist succeeded, or its first since it was
//	          demoted (whose release removed its entry), so a leader may pick it as its successor
//	elected   this candidate became leader (T is when its OnElected equivalent ran;
//	          ours also say why it was granted, Lease.Reason, in Reason)
//	demoted   this candidate lost leadership while campaigning (T is OnDemoted's
//	          last act: its return; the line is written demotedLineAfter later, or
//	          with the child's next event)
//	stopping  the child read "stop" and is about to stop campaigning
//	stopped   the campaign has stopped (and released, if it led)
//	transfer  the child read "transfer" and is about to call Elector.Transfer
//	transferred  Elector.Transfer returned: the successor's Term and ID (Holder), or the error (Msg)
//	counts    reply to "counts": statements sent since the child started
//	idle      reply of an idle child: its cost report
//	handover  reply of a herd child to "handover": what it cost
//	scale     reply of a scale-names child to "report": what it measured
//	error     something failed; Msg says what
//
// A scale-proc child's elected and demoted carry the election's Name.
type event struct {
	Ev     string       `json:"ev"`
	T      int64        `json:"t"` // CLOCK_MONOTONIC, ns
	Term   uint64       `json:"term,omitempty"`
	Counts *counts      `json:"counts,omitempty"`
	Idle   *idleReport  `json:"idle,omitempty"`
	Herd   *herdReport  `json:"herd,omitempty"`
	Scale  *scaleReport `json:"scale,omitempty"`
	Name   string       `json:"name,omitempty"`
	Reason string       `json:"reason,omitempty"`
	Holder string       `json:"holder,omitempty"`
	Msg    string       `json:"msg,omitempty"`
}

// Commands the parent writes to a candidate child's standard input, one a
// line: "stop", "resume", "counts", "exit", and for ours "transfer ID"
// (Elector.Transfer to the candidate ID; "transfer" alone: to the best).
// End of input means the parent is gone: the child exits at once.
const (
	cmdStop     = "stop"
	cmdResume   = "resume"
	cmdCounts   = "counts"
	cmdExit     = "exit"
	cmdTransfer = "transfer"
)

// emitter writes events, one JSON object a line, stamped with
// CLOCK_MONOTONIC, which all processes on the host share.
type emitter struct {
	mu sync.Mutex
	w  *bufio.Writer
}

func newEmitter(w io.Writer) *emitter { return &emitter{w: bufio.NewWriter(w)} }

func (e *emitter) emit(ev event) {
	e.write(ev, 0)
}

// emitAfter is emit, with the line written (with any line after it) only
// after d, or at the next emit if that comes first: the parent, woken by
// the line, runs on the host's cores then, rather than at once. The time
// is taken now.
func (e *emitter) emitAfter(ev event, d time.Duration) {
	e.write(ev, d)
}

func (e *emitter) write(ev event, after time.Duration) {
	t, err := monotime.Now()
	if err != nil {
		panic(err) // CLOCK_MONOTONIC is always there on Linux
	}
	ev.T = t
	b, _ := json.Marshal(ev)
	e.mu.Lock()
	defer e.mu.Unlock()
	e.w.Write(append(b, '\n'))
	if after <= 0 {
		e.w.Flush()
		return
	}
	time.AfterFunc(after, func() {
		e.mu.Lock()
		defer e.mu.Unlock()
		e.w.Flush()
	})
}

// flush writes the lines not written yet (see emitAfter).
func (e *emitter) flush() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.w.Flush()
}

// demotedLineAfter is how long after OnDemoted a candidate child writes
// the line of its "demoted" event (see emitAfter), unless another event
// comes first. The line wakes the parent process, which, written at once,
// ran on the host's two cores while the old leader's release and the
// successor's grant did: a handover's gap is measured from OnDemoted's
// return, and the bench's own work in it is no elector's.
const demotedLineAfter = 50 * time.Millisecond

func (e *emitter) fail(err error) int {
	e.emit(event{Ev: "error", Msg: err.Error()})
	return 1
}

// candidate is one campaign: an elector of some kind for the election.
// start returns at once; stop stops campaigning, releasing leadership if
// held, and returns when that is done.
type candidate interface {
	start()
	stop()
}

// transferrer is a candidate that can hand its leadership over (ours).
type transferrer interface {
	candidate
	// transfer calls Elector.Transfer: to the candidate whose ID is to,
	// or the best one when to is "".
	transfer(ctx context.Context, to string) (leader.Lease, error)
}

// hooks are how a candidate reports to its process.
type hooks struct {
	ready func() // after the first attempt; called once per campaign
	// elected gets the term, where the kind has one, and why the lease
	// was granted, where the kind says (ours: Lease.Reason).
	elected func(term uint64, reason string)
	demoted func()
	// enlisted is called after each Enlist that succeeds (ours, on a
	// store that implements leader.Transferer); may be nil.
	enlisted func()
}

// backend is what the campaigns of one child process share (a pool, a
// store, a client) and how to make a campaign on it.
type backend struct {
	newCandidate func(id string, h hooks) (candidate, error)
	counts       func() counts
	// acquires counts the store's Acquire calls (ours only; nil for the
	// peers).
	acquires func() int64
	// warmUp opens what the campaigns share (a pool connection, a client
	// connection), so that an idle-cost measurement leaves it out.
	warmUp func() error
	close  func()
}

func childMain(role string) int {
	em := newEmitter(os.Stdout)
	var spec childSpec
	if err := json.Unmarshal([]byte(os.Getenv(envSpec)), &spec); err != nil {
		return em.fail(fmt.Errorf("reading %s: %w", envSpec, err))
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})).
		With(slog.String("child", spec.ID), slog.String("kind", spec.Kind))
	slog.SetDefault(logger)
	switch role {
	case roleCandidate:
		return runCandidate(spec, em, logger)
	case roleIdle:
		return runIdle(spec, em, logger)
	case roleHerd:
		return runHerd(spec, em, logger)
	case roleScaleNames:
		return runScaleNames(spec, em, logger)
	case roleScaleProc:
		return runScaleProc(spec, em, logger)
	}
	return em.fail(fmt.Errorf("unknown child role %q", role))
}

func runCandidate(spec childSpec, em *emitter, logger *slog.Logger) int {
	defer em.flush() // a "demoted" line not written yet (see emitAfter)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	be, err := newBackend(ctx, spec, logger)
	cancel()
	if err != nil {
		return em.fail(err)
	}
	defer be.close()
	campaign := func() (candidate, error) {
		var readyOnce sync.Once
		// Whether "enlisted" was sent since the campaign began or was
		// last demoted: a leader's release removes its own entry among
		// the candidates, so a demoted one is enlisted again only by its
		// next attempt. The Elector makes none before OnDemoted returns.
		var enlistedSent atomic.Bool
		return be.newCandidate(spec.ID, hooks{
			ready: func() { readyOnce.Do(func() { em.emit(event{Ev: "ready"}) }) },
			elected: func(term uint64, reason string) {
				tracef("elected %s", spec.ID)
				em.emit(event{Ev: "elected", Term: term, Reason: reason})
			},
			demoted: func() {
				tracef("demoted %s", spec.ID)
				em.emitAfter(event{Ev: "demoted"}, demotedLineAfter)
				enlistedSent.Store(false)
			},
			enlisted: func() {
				if enlistedSent.CompareAndSwap(false, true) {
					em.emit(event{Ev: "enlisted"})
				}
			},
		})
	}
	time.Sleep(spec.StartDelay.D())
	c, err := campaign()
	if err != nil {
		return em.fail(err)
	}
	c.start()
	running := true
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		cmd, arg, _ := strings.Cut(in.Text(), " ")
		switch cmd {
		case cmdStop:
			tracef("stopping %s", spec.ID)
			em.emit(event{Ev: "stopping"})
			if running {
				c.stop()
				running = false
			}
			tracef("stopped %s", spec.ID)
			em.emit(event{Ev: "stopped"})
		case cmdResume:
			if !running {
				if c, err = campaign(); err != nil {
					return em.fail(err)
				}
				c.start()
				running = true
			}
		case cmdCounts:
			n := be.counts()
			em.emit(event{Ev: "counts", Counts: &n})
		case cmdTransfer:
			em.emit(event{Ev: "transfer"})
			if running {
				transfer(c, arg, spec.Timing, em)
			} else {
				em.emit(event{Ev: "transferred", Msg: "not campaigning"})
			}
		case cmdExit:
			if running {
				c.stop()
			}
			return 0
		}
	}
	// The parent is gone: leave at once, like a killed process.
	return 1
}

// transfer has c hand its leadership over to the candidate whose ID is to
// (the best one if to is ""), waiting at most two TTLs, and emits
// "transferred" with the outcome.
func transfer(c candidate, to string, t timing, em *emitter) {
	tc, ok := c.(transferrer)
	if !ok {
		em.emit(event{Ev: "transferred", Msg: fmt.Sprintf("this kind cannot hand over: %v", errors.ErrUnsupported)})
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*t.TTL.D())
	defer cancel()
	l, err := tc.transfer(ctx, to)
	if err != nil {
		em.emit(event{Ev: "transferred", Msg: err.Error()})
		return
	}
	em.emit(event{Ev: "transferred", Term: l.Term, Holder: l.HolderID})
}

// idleReport is what an idle child measured: the cost of N idle followers
// over the process with the shared pool/store/client and no electors.
type idleReport struct {
	N                int     `json:"n"`
	HeapInuseBytes   float64 `json:"heap_inuse_bytes_per_elector"`
	HeapAllocBytes   float64 `json:"heap_alloc_bytes_per_elector"`
	Goroutines       float64 `json:"goroutines_per_elector"`
	ReadyAfterMillis float64 `json:"ready_after_ms"` // until all had made their first attempt
}

type memSample struct {
	heapInuse, heapAlloc uint64
	goroutines           int
}

func sampleMem() memSample {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return memSample{heapInuse: ms.HeapInuse, heapAlloc: ms.HeapAlloc, goroutines: runtime.NumGoroutine()}
}

// runIdle starts spec.IdleN followers of an election whose leader runs in
// another process, waits until each has made its first attempt and a
// little more, and reports what they cost. It then waits for "exit", so
// that the parent can count their server connections meanwhile.
func runIdle(spec childSpec, em *emitter, logger *slog.Logger) int {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	be, err := newBackend(ctx, spec, logger)
	cancel()
	if err != nil {
		return em.fail(err)
	}
	defer be.close()
	if err := be.warmUp(); err != nil {
		return em.fail(err)
	}
	before := sampleMem()
	start := time.Now()
	var ready atomic.Int64
	allReady := make(chan struct{})
	cands := make([]candidate, spec.IdleN)
	for i := range cands {
		var once sync.Once
		c, err := be.newCandidate(fmt.Sprintf("%s-%d", spec.ID, i), hooks{
			ready: func() {
				once.Do(func() {
					if ready.Add(1) == int64(spec.IdleN) {
						close(allReady)
					}
				})
			},
			elected: func(uint64, string) { em.emit(event{Ev: "error", Msg: "an idle follower was elected"}) },
			demoted: func() {},
		})
		if err != nil {
			return em.fail(err)
		}
		cands[i] = c
		c.start()
	}
	select {
	case <-allReady:
	case <-time.After(3 * time.Minute):
		return em.fail(fmt.Errorf("only %d of %d idle followers made their first attempt in 3 minutes", ready.Load(), spec.IdleN))
	}
	readyAfter := time.Since(start)
	time.Sleep(3 * time.Second) // let first-attempt garbage and transient goroutines go
	after := sampleMem()
	n := float64(spec.IdleN)
	em.emit(event{Ev: "idle", Idle: &idleReport{
		N:                spec.IdleN,
		HeapInuseBytes:   (float64(after.heapInuse) - float64(before.heapInuse)) / n,
		HeapAllocBytes:   (float64(after.heapAlloc) - float64(before.heapAlloc)) / n,
		Goroutines:       float64(after.goroutines-before.goroutines) / n,
		ReadyAfterMillis: float64(readyAfter.Microseconds()) / 1000,
	}})
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		if in.Text() == cmdExit {
			break
		}
	}
	// Leave without stopping each follower: the process ends, and with it
	// its connections and sessions.
	return 0
}
