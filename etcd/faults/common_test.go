//go:build unix

package faults_test

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/etcd"
	"github.com/leaderelect/leader/etcd/etcdtest"
	"github.com/leaderelect/leader/internal/fenced"
	"github.com/leaderelect/leader/internal/history"
	"github.com/leaderelect/leader/internal/monotime"
	"github.com/leaderelect/leader/internal/pgtest"
)

const (
	election = "etcd-faulty"
	resource = "leader-output"
	// ttl is every Elector's TTL; RenewInterval is TTL/3, DriftMargin
	// TTL/20 and StopGrace TTL/5, the defaults.
	ttl         = 2 * time.Second
	driftMargin = ttl / 20
	candidates  = 3
	members     = 3
	// writeEvery is the pace of each leader's writes to the fenced
	// register.
	writeEvery = 20 * time.Millisecond
	// maxInjectDelay bounds the random wait between a leader having
	// written and the fault.
	maxInjectDelay = 700 * time.Millisecond
	// maxTakeover bounds every takeover, from the end of the old
	// leader's belief to the new leader's OnElected, plus the outage
	// where the scenario has one.
	maxTakeover = 3 * ttl
	// healthyWithin bounds the wait for the cluster to be healthy again
	// after a member was restarted or resumed.
	healthyWithin = 30 * time.Second
	// prefix is the Stores' key prefix; every scenario has a cluster of
	// its own.
	prefix = "faults/"
)

// endpoints says which etcd members a candidate's client knows.
type endpoints int

const (
	// ownMember: candidate i's client has member i's proxied endpoint
	// alone, so that cutting or killing that member cuts it off.
	ownMember endpoints = iota
	// allMembers: every client has every member's proxied endpoint.
	allMembers
)

// env is one scenario: a 3-member etcd cluster, candidates on it, the
// fenced register their leaders write to, and the directory of their
// histories of beliefs.
type env struct {
	t       *testing.T
	cluster *etcdtest.Cluster
	mode    endpoints
	dir     string // history files
	reg     *fenced.Register
	pool    *pgxpool.Pool // to the register; no fault touches it

	mu         sync.Mutex
	acceptedBy map[uint64]int // accepted writes per term
	cands      []*candidate
	nextID     int
	killedAt   map[string]int64 // instance → CLOCK_MONOTONIC of its kill
	unprovoked int              // leaderships lost without a fault
}

// candidate is one Elector with a client and Store of its own.
type candidate struct {
	id     string
	member int // its own member, in mode ownMember
	cli    *clientv3.Client
	store  *etcd.Store
	e      *leader.Elector
	rec    *history.Recorder
	stop   func()
	dead   atomic.Bool // killed: its work makes no more writes
	closed atomic.Bool // rec closed
}

// newEnv starts a cluster of three members, a fenced register on a fresh
// PostgreSQL database, and three candidates.
func newEnv(t *testing.T, mode endpoints) *env {
	t.Helper()
	cluster := etcdtest.StartCluster(t, members)
	pool := pgtest.OpenPool(t, pgtest.NewDatabase(t))
	reg, err := fenced.Setup(callCtx(t), pool, "fenced")
	if err != nil {
		t.Fatal(err)
	}
	v := &env{
		t: t, cluster: cluster, mode: mode, dir: t.TempDir(), reg: reg, pool: pool,
		acceptedBy: map[uint64]int{}, killedAt: map[string]int64{},
	}
	for i := range candidates {
		v.startCandidate(i)
	}
	return v
}

// newClient returns an etcd client of eps that reconnects within half a
// second of a member or proxy coming back (gRPC's default backoff waits
// up to two minutes).
func newClient(t *testing.T, eps []string) *clientv3.Client {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{
		Endpoints: eps,
		Logger:    zap.NewNop(),
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
	if err != nil {
		t.Fatalf("etcd client: %v", err)
	}
	return cli
}

// startCandidate starts an Elector with a new ID; in mode ownMember its
// client knows member alone.
func (v *env) startCandidate(member int) *candidate {
	t := v.t
	t.Helper()
	v.mu.Lock()
	id := fmt.Sprint("e", v.nextID)
	v.nextID++
	v.mu.Unlock()
	eps := v.cluster.Endpoints()
	if v.mode == ownMember {
		eps = []string{v.cluster.Member(member).Endpoint()}
	}
	c := &candidate{id: id, member: member, cli: newClient(t, eps)}
	t.Cleanup(func() { c.cli.Close() })
	store, err := etcd.New(c.cli, etcd.WithPrefix(prefix), etcd.WithLogger(testLogger(id+"/store")))
	if err != nil {
		t.Fatal(err)
	}
	c.store = store
	t.Cleanup(func() { store.Close() })
	if c.rec, err = history.Create(v.dir, election); err != nil {
		t.Fatal(err)
	}
	onElected, onDemoted := c.rec.Hooks(id)
	c.e, err = leader.New(c.rec.Store(store, id), leader.Config{
		Name:   election,
		ID:     id,
		TTL:    ttl,
		Logger: testLogger(id),
		OnElected: func(ctx context.Context) {
			onElected(ctx)
			v.work(ctx, c)
		},
		OnDemoted: onDemoted,
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		// A killed candidate's Run meets a closed Store: not a failure.
		if err := c.e.Run(ctx); err != nil && !c.dead.Load() {
			t.Errorf("%s: Run: %v", id, err)
		}
	}()
	var once sync.Once
	c.stop = func() {
		once.Do(func() {
			cancel()
			<-done
		})
	}
	t.Cleanup(c.stop)
	v.mu.Lock()
	v.cands = append(v.cands, c)
	v.mu.Unlock()
	return c
}

// work is a leader's work: write the term to the register every
// writeEvery until leadership ends or the candidate is killed. A write
// already sent is let finish.
func (v *env) work(ctx context.Context, c *candidate) {
	term, _ := leader.TermFrom(ctx)
	tick := time.NewTicker(writeEvery)
	defer tick.Stop()
	for i := 0; !c.dead.Load(); i++ {
		wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		accepted, err := v.reg.Write(wctx, v.pool, resource, term, c.id, fmt.Sprintf("%s/%d/%d", c.id, term, i))
		cancel()
		switch {
		case err != nil:
			v.t.Errorf("%s: %v", c.id, err)
			return
		case accepted:
			v.mu.Lock()
			v.acceptedBy[term]++
			v.mu.Unlock()
		case ctx.Err() == nil && !c.dead.Load():
			// A greater term was accepted before this write returned,
			// and this instance still believes it leads.
			v.t.Errorf("%s: write with term %d refused while it believes it leads", c.id, term)
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// written returns how many writes with term were accepted.
func (v *env) written(term uint64) int {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.acceptedBy[term]
}

// live returns the candidates not killed.
func (v *env) live() []*candidate {
	v.mu.Lock()
	defer v.mu.Unlock()
	var out []*candidate
	for _, c := range v.cands {
		if !c.dead.Load() {
			out = append(out, c)
		}
	}
	return out
}

// nextLeader waits for a leader with a term above after that has had three
// writes accepted. It may be the leader of term after itself, elected
// again. If none comes within the given time, it fails the test and
// returns nil, so that the scenario stops injecting faults but still
// checks the histories, which tell what happened instead.
func (v *env) nextLeader(after uint64, within time.Duration) (*candidate, uint64) {
	v.t.Helper()
	for deadline := time.Now().Add(within); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		for _, c := range v.live() {
			if st := c.e.Status(); st.IsLeader && st.Term > after && v.written(st.Term) >= 3 {
				return c, st.Term
			}
		}
	}
	var seen []string
	for _, c := range v.live() {
		st := c.e.Status()
		seen = append(seen, fmt.Sprintf("%s: leader %v, term %d, %d writes", c.id, st.IsLeader, st.Term, v.written(st.Term)))
	}
	v.t.Errorf("no leader with a term above %d that has written within %v; now %v", after, within, seen)
	return nil, 0
}

// kill models the death of c's process: from now on its work writes
// nothing, its client and Store are closed without releasing anything,
// and its events recorded after this instant are left out of the history
// (see the package documentation). It returns the instant.
func (v *env) kill(c *candidate) int64 {
	v.t.Helper()
	at := now(v.t)
	c.dead.Store(true)
	v.mu.Lock()
	v.killedAt[c.id] = at
	v.mu.Unlock()
	c.cli.Close()
	c.store.Close()
	c.stop()
	return at
}

// lateWrite makes a write with the deposed leader's term, as a leader that
// missed its demotion would, after its successor's term nextTerm has
// written: the fence must refuse it.
func (v *env) lateWrite(trial int, id string, term, nextTerm uint64) {
	v.t.Helper()
	accepted, err := v.reg.Write(callCtx(v.t), v.pool, resource, term, id+"-late", "late")
	if err != nil {
		v.t.Fatal(err)
	}
	if accepted {
		v.t.Errorf("trial %d: a write with the deposed leader's term %d was accepted after term %d had written", trial, term, nextTerm)
	}
}

// stopAll stops every Elector (releasing, if leading) and closes the
// recorders.
func (v *env) stopAll() {
	v.t.Helper()
	var wg sync.WaitGroup
	for _, c := range v.live() {
		wg.Go(c.stop)
	}
	wg.Wait()
	v.mu.Lock()
	cands := v.cands
	v.mu.Unlock()
	for _, c := range cands {
		if err := c.rec.Close(); err != nil && !c.dead.Load() {
			v.t.Errorf("%s: %v", c.id, err)
		}
	}
}

// events loads the history of beliefs, without what killed candidates
// recorded after their kill: a dead process records nothing.
func (v *env) events() []history.Event {
	v.t.Helper()
	evs, err := history.Load(v.dir)
	if err != nil {
		v.t.Fatal(err)
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	kept := evs[:0]
	for _, e := range evs {
		if at, ok := v.killedAt[e.Instance]; ok && e.At > at {
			continue
		}
		kept = append(kept, e)
	}
	return kept
}

// result is what one scenario, or a tally of them, found.
type result struct {
	trials, ledOn, unprovoked                    int
	overlaps, termRegressions, termsGrantedTwice int
	staleRefused, staleAccepted                  int
	takeovers                                    []time.Duration
}

func (r *result) add(o result) {
	r.trials += o.trials
	r.ledOn += o.ledOn
	r.unprovoked += o.unprovoked
	r.overlaps += o.overlaps
	r.termRegressions += o.termRegressions
	r.termsGrantedTwice += o.termsGrantedTwice
	r.staleRefused += o.staleRefused
	r.staleAccepted += o.staleAccepted
	r.takeovers = append(r.takeovers, o.takeovers...)
}

// check checks the histories of beliefs and of the register, and returns
// the scenario's result: history.Check must pass with bounds b (no
// overlap, no term regression, no takeover slower than b.MaxTakeover, no
// unexplained open interval), no term may be granted to two instances,
// every faulted term must have been taken over, the register's history
// must be linearizable, and no stale write may have been accepted.
// Takeovers are counted only from the faulted terms.
func (v *env) check(b history.Bounds, faultedTerms []uint64) (result, history.Report) {
	t := v.t
	t.Helper()
	evs := v.events()
	rep := history.Check(evs, b)
	if !rep.OK() {
		t.Errorf("the history of beliefs fails (takeover bound %v):\n%v", b.MaxTakeover, rep)
	}
	v.mu.Lock()
	r := result{overlaps: len(rep.Overlaps), termRegressions: len(rep.TermRegressions), unprovoked: v.unprovoked}
	v.mu.Unlock()

	grantedTo := map[uint64]map[string]bool{}
	for _, e := range evs {
		if e.Kind == history.Granted {
			if grantedTo[e.Term] == nil {
				grantedTo[e.Term] = map[string]bool{}
			}
			grantedTo[e.Term][e.Instance] = true
		}
	}
	for term, to := range grantedTo {
		if len(to) > 1 {
			r.termsGrantedTwice++
			t.Errorf("term %d granted to %d instances: %v", term, len(to), to)
		}
	}

	for _, tk := range rep.Takeovers {
		for _, ft := range faultedTerms {
			if tk.From.Term == ft {
				r.takeovers = append(r.takeovers, tk.Gap)
			}
		}
	}
	if len(r.takeovers) != len(faultedTerms) {
		t.Errorf("%d takeovers from the %d faulted leaders (terms %v):\n%v", len(r.takeovers), len(faultedTerms), faultedTerms, rep)
	}

	ops := v.reg.History()
	if ok, _ := fenced.CheckLinearizable(ops); !ok {
		t.Errorf("the fenced register's history of %d operations is not linearizable", len(ops))
	}
	stale := staleAccepted(ops)
	for _, op := range stale {
		t.Errorf("a stale write was accepted: %v", op)
	}
	accepted, refused := 0, 0
	for _, op := range ops {
		switch {
		case op.Kind != fenced.Write || op.Unknown:
		case op.Accepted:
			accepted++
		default:
			refused++
		}
	}
	r.staleRefused, r.staleAccepted = refused, len(stale)
	t.Logf("%d intervals; takeovers from faulted leaders %v; fenced register: %d writes accepted, %d refused",
		len(rep.Intervals), history.Summarize(r.takeovers), accepted, refused)
	return r, rep
}

// interval returns the interval of instance's leadership with term.
func interval(rep history.Report, instance string, term uint64) (history.Interval, bool) {
	for _, iv := range rep.Intervals {
		if iv.Instance == instance && iv.Term == term {
			return iv, true
		}
	}
	return history.Interval{}, false
}

// staleAccepted returns the accepted writes whose term is smaller than
// that of a write accepted before they were sent: what a deposed leader
// attempted after its successor wrote, and the fence should have refused.
func staleAccepted(ops []fenced.Op) []fenced.Op {
	var done []fenced.Op
	for _, op := range ops {
		if op.Kind == fenced.Write && op.Accepted && !op.Unknown {
			done = append(done, op)
		}
	}
	sort.Slice(done, func(i, j int) bool { return done[i].Return < done[j].Return })
	var stale []fenced.Op
	for _, op := range done {
		var top uint64 // greatest term accepted before op was sent
		for _, prior := range done {
			if prior.Return >= op.Invoke {
				break
			}
			top = max(top, prior.Term)
		}
		if top > op.Term {
			stale = append(stale, op)
		}
	}
	return stale
}

// settle lets the leader of term lead for 1.5 TTL, then waits a random 0
// to maxInjectDelay, so that the fault comes once renewals have carried
// its lease past what its grant alone gave it, anywhere between two
// renewals. It returns the leader then: the same one, unless leadership
// changed without a fault, which is counted (v.unprovoked) and logged.
// It returns nil if no leader came (see nextLeader).
func (v *env) settle(cur *candidate, term uint64) (*candidate, uint64) {
	v.t.Helper()
	time.Sleep(ttl + ttl/2 + rand.N(maxInjectDelay+1))
	if st := cur.e.Status(); st.IsLeader && st.Term == term {
		return cur, term
	}
	v.mu.Lock()
	v.unprovoked++
	v.mu.Unlock()
	v.t.Logf("%s lost its leadership of term %d without a fault", cur.id, term)
	return v.nextLeader(term, maxTakeover+2*ttl)
}

// now reads CLOCK_MONOTONIC, the clock of the histories.
func now(t *testing.T) int64 {
	t.Helper()
	at, err := monotime.Now()
	if err != nil {
		t.Fatal(err)
	}
	return at
}

func testLogger(instance string) *slog.Logger {
	if os.Getenv("LEADER_TEST_LOG") == "" {
		return slog.New(slog.DiscardHandler)
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug})).With("instance", instance)
}

// callCtx returns a context for one call, bounded generously.
func callCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// timeout returns a context that ends after d.
func timeout(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}
