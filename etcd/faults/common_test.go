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
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/etcd"
	"github.com/leaderelect/leader/etcd/etcdtest"
	"github.com/leaderelect/leader/internal/childproc"
	"github.com/leaderelect/leader/internal/fenced"
	"github.com/leaderelect/leader/internal/history"
	"github.com/leaderelect/leader/internal/pgtest"
)

const (
	election = "etcd-faulty"
	resource = "leader-output"
	// ttl is every Elector's TTL; RenewInterval is TTL/3, DriftMargin
	// TTL/20 and StopGrace TTL/5, the defaults.
	ttl         = 2 * time.Second
	driftMargin = ttl / 20
	stopGrace   = ttl / 5
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
	// registerTable is the fenced register's table.
	registerTable = "fenced"
)

// resourceOf names the register that the leaders of name write to.
func resourceOf(name string) string { return resource + "/" + name }

// endpoints says which etcd members a candidate's client knows, and how
// it reaches them.
type endpoints int

const (
	// ownMember: candidate i's client has member i's endpoint behind
	// etcdtest's proxy alone, so that killing that member cuts it off.
	ownMember endpoints = iota
	// allMembers: every client has every member's endpoint behind
	// etcdtest's proxies.
	allMembers
	// ownLink: candidate i's client reaches member i alone, through a
	// toxiproxy proxy of its own (a link), which a fault of the leader's
	// client acts on.
	ownLink
)

// env is one scenario whose candidates run in this process: a 3-member
// etcd cluster, candidates on it, the fenced register their leaders write
// to, and the directory of their histories of beliefs.
type env struct {
	t       *testing.T
	cluster *etcdtest.Cluster
	mode    endpoints
	proxies *toxiproxy.ApiServer // the links' server, in mode ownLink
	dir     string               // history files
	reg     *fenced.Register
	pool    *pgxpool.Pool // to the register; no fault touches it

	mu         sync.Mutex
	acceptedBy map[uint64]int // accepted writes per term
	cands      []*candidate
	nextID     int
	unprovoked int // leaderships lost without a fault
}

// candidate is one Elector with a client and Store of its own.
type candidate struct {
	id     string
	member int   // its own member, in modes ownMember and ownLink
	link   *link // its link to its member, in mode ownLink
	cli    *clientv3.Client
	rs     *recordingStore
	e      *leader.Elector
	rec    *history.Recorder
	stop   func()
}

// newEnv starts a cluster of three members, a fenced register on a fresh
// PostgreSQL database, and three candidates.
func newEnv(t *testing.T, mode endpoints) *env {
	t.Helper()
	cluster := etcdtest.StartCluster(t, members)
	pool := pgtest.OpenPool(t, pgtest.NewDatabase(t))
	reg, err := fenced.Setup(callCtx(t), pool, registerTable)
	if err != nil {
		t.Fatal(err)
	}
	v := &env{
		t: t, cluster: cluster, mode: mode, dir: t.TempDir(), reg: reg, pool: pool,
		acceptedBy: map[uint64]int{},
	}
	if mode == ownLink {
		v.proxies = toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())
	}
	for i := range candidates {
		v.startCandidate(i)
	}
	return v
}

// newClient returns an etcd client of eps that reconnects within half a
// second of a member or proxy coming back (gRPC's default backoff waits
// up to two minutes), with the dial options opts besides.
func newClient(t *testing.T, eps []string, opts ...grpc.DialOption) *clientv3.Client {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{
		Endpoints: eps,
		Logger:    zap.NewNop(),
		DialOptions: append([]grpc.DialOption{grpc.WithConnectParams(grpc.ConnectParams{
			Backoff: backoff.Config{
				BaseDelay:  50 * time.Millisecond,
				Multiplier: 1.6,
				Jitter:     0.2,
				MaxDelay:   500 * time.Millisecond,
			},
			MinConnectTimeout: time.Second,
		})}, opts...),
	})
	if err != nil {
		t.Fatalf("etcd client: %v", err)
	}
	return cli
}

// startCandidate starts an Elector with a new ID; in modes ownMember and
// ownLink its client knows member alone.
func (v *env) startCandidate(member int) *candidate {
	t := v.t
	t.Helper()
	v.mu.Lock()
	id := fmt.Sprint("e", v.nextID)
	v.nextID++
	v.mu.Unlock()
	c := &candidate{id: id, member: member}
	eps := v.cluster.Endpoints()
	var opts []grpc.DialOption
	switch v.mode {
	case ownMember:
		eps = []string{v.cluster.Member(member).Endpoint()}
	case ownLink:
		// Stopped after the client is closed (t.Cleanup is LIFO), so
		// that no connection through it carries data when it stops.
		c.link = newLink(t, v.proxies, id, v.cluster.Member(member).DirectEndpoint())
		eps = []string{c.link.url()}
		opts = append(opts, grpc.WithContextDialer(c.link.dial))
	}
	c.cli = newClient(t, eps, opts...)
	t.Cleanup(func() { c.cli.Close() })
	store, err := etcd.New(c.cli, etcd.WithPrefix(prefix), etcd.WithLogger(testLogger(id+"/store")))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { store.Close() })
	if c.rec, err = history.Create(v.dir, election); err != nil {
		t.Fatal(err)
	}
	c.rs = newRecordingStore(store, nil)
	c.rs.add(c.rec, id)
	onElected, onDemoted := c.rec.Hooks(id)
	c.e, err = leader.New(c.rs, leader.Config{
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
		if err := c.e.Run(ctx); err != nil {
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
// writeEvery until leadership ends. A write already sent is let finish.
func (v *env) work(ctx context.Context, c *candidate) {
	term, _ := leader.TermFrom(ctx)
	tick := time.NewTicker(writeEvery)
	defer tick.Stop()
	for i := 0; ; i++ {
		wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		accepted, err := v.reg.Write(wctx, v.pool, resourceOf(election), term, c.id, fmt.Sprintf("%s/%d/%d", c.id, term, i))
		cancel()
		switch {
		case err != nil:
			v.t.Errorf("%s: %v", c.id, err)
			return
		case accepted:
			v.mu.Lock()
			v.acceptedBy[term]++
			v.mu.Unlock()
		case ctx.Err() == nil:
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

// all returns the candidates.
func (v *env) all() []*candidate {
	v.mu.Lock()
	defer v.mu.Unlock()
	return append([]*candidate(nil), v.cands...)
}

// nextLeader waits for a leader with a term above after that has had three
// writes accepted. It may be the leader of term after itself, elected
// again. If none comes within the given time, it fails the test and
// returns nil, so that the scenario stops injecting faults but still
// checks the histories, which tell what happened instead.
func (v *env) nextLeader(after uint64, within time.Duration) (*candidate, uint64) {
	v.t.Helper()
	for deadline := time.Now().Add(within); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		for _, c := range v.all() {
			if st := c.e.Status(); st.IsLeader && st.Term > after && v.written(st.Term) >= 3 {
				return c, st.Term
			}
		}
	}
	var seen []string
	for _, c := range v.all() {
		st := c.e.Status()
		seen = append(seen, fmt.Sprintf("%s: leader %v, term %d, %d writes", c.id, st.IsLeader, st.Term, v.written(st.Term)))
	}
	v.t.Errorf("no leader with a term above %d that has written within %v; now %v", after, within, seen)
	return nil, 0
}

// lateWrite makes a write with the deposed leader's term, as a leader that
// missed its demotion would, after its successor's term nextTerm has
// written: the fence must refuse it.
func (v *env) lateWrite(trial int, id string, term, nextTerm uint64) {
	v.t.Helper()
	lateWrite(v.t, v.reg, v.pool, trial, election, id, term, nextTerm)
}

// lateWrite writes to name's register with a deposed leader's term, after
// its successor's term nextTerm has written, as a deposed leader that
// missed its demotion would, and fails t unless the fence refuses it.
func lateWrite(t *testing.T, reg *fenced.Register, pool *pgxpool.Pool, trial int, name, id string, term, nextTerm uint64) {
	t.Helper()
	accepted, err := reg.Write(callCtx(t), pool, resourceOf(name), term, id+"-late", "late")
	if err != nil {
		t.Fatal(err)
	}
	if accepted {
		t.Errorf("trial %d: a write to %s with the deposed leader's term %d was accepted after term %d had written", trial, name, term, nextTerm)
	}
}

// stopAll stops every Elector (releasing, if leading) and closes the
// recorders.
func (v *env) stopAll() {
	v.t.Helper()
	cands := v.all()
	var wg sync.WaitGroup
	for _, c := range cands {
		wg.Go(c.stop)
	}
	wg.Wait()
	for _, c := range cands {
		if err := c.rec.Close(); err != nil {
			v.t.Errorf("%s: %v", c.id, err)
		}
	}
}

// check checks the scenario's histories (see judge) and that the
// Electors renewed with RenewBatch, never with Renew.
func (v *env) check(b history.Bounds, fs []faulted) (result, history.Report) {
	t := v.t
	t.Helper()
	evs, err := history.Load(v.dir)
	if err != nil {
		t.Fatal(err)
	}
	r, rep := judge(t, evs, b, fs, v.reg.History())
	v.mu.Lock()
	r.unprovoked = v.unprovoked
	v.mu.Unlock()
	var batches, renewals, renews int64
	for _, c := range v.all() {
		b, n, _, rn := c.rs.stats()
		batches, renewals, renews = batches+b, renewals+n, renews+rn
	}
	if batches == 0 || renews > 0 {
		t.Errorf("the Electors renewed with %d RenewBatch calls (%d renewals) and %d Renew calls: want RenewBatch alone", batches, renewals, renews)
	}
	return r, rep
}

// faulted is a leadership a trial faulted: its name, instance and term,
// and the CLOCK_MONOTONIC instant of the fault.
type faulted struct {
	name string
	id   string
	term uint64
	at   int64
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

// judge checks a scenario's history of beliefs, evs, and its fenced
// register's, ops, and returns the scenario's result: history.Check must
// pass with bounds b (no overlap, no term regression, no takeover slower
// than b.MaxTakeover, no unexplained open interval), no term of a name
// may be granted to two instances, every faulted leadership must have
// been taken over, the register's history must be linearizable, and no
// stale write may have been accepted. Takeovers are counted only from the
// faulted leaderships.
func judge(t *testing.T, evs []history.Event, b history.Bounds, fs []faulted, ops []fenced.Op) (result, history.Report) {
	t.Helper()
	rep := history.Check(evs, b)
	if !rep.OK() {
		t.Errorf("the history of beliefs fails (takeover bound %v):\n%v", b.MaxTakeover, rep)
	}
	r := result{overlaps: len(rep.Overlaps), termRegressions: len(rep.TermRegressions)}

	type nameTerm struct {
		name string
		term uint64
	}
	grantedTo := map[nameTerm]map[string]bool{}
	for _, e := range evs {
		if e.Kind == history.Granted {
			k := nameTerm{e.Name, e.Term}
			if grantedTo[k] == nil {
				grantedTo[k] = map[string]bool{}
			}
			grantedTo[k][e.Instance] = true
		}
	}
	for k, to := range grantedTo {
		if len(to) > 1 {
			r.termsGrantedTwice++
			t.Errorf("term %d of %s granted to %d instances: %v", k.term, k.name, len(to), to)
		}
	}

	for _, tk := range rep.Takeovers {
		for _, f := range fs {
			if tk.From.Name == f.name && tk.From.Term == f.term {
				r.takeovers = append(r.takeovers, tk.Gap)
			}
		}
	}
	if len(r.takeovers) != len(fs) {
		t.Errorf("%d takeovers from the %d faulted leaderships (%v):\n%v", len(r.takeovers), len(fs), fs, rep)
	}

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
	t.Logf("%d intervals; takeovers from faulted leaderships %v; fenced register: %d writes accepted, %d refused",
		len(rep.Intervals), history.Summarize(r.takeovers), accepted, refused)
	return r, rep
}

// interval returns the interval of instance's leadership of name with
// term.
func interval(rep history.Report, name, instance string, term uint64) (history.Interval, bool) {
	for _, iv := range rep.Intervals {
		if iv.Name == name && iv.Instance == instance && iv.Term == term {
			return iv, true
		}
	}
	return history.Interval{}, false
}

// staleAccepted returns the accepted writes whose term is smaller than
// that of a write to the same register accepted before they were sent:
// what a deposed leader attempted after its successor wrote, and the
// fence should have refused.
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
			if prior.Resource == op.Resource {
				top = max(top, prior.Term)
			}
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
	time.Sleep(settleFor())
	if st := cur.e.Status(); st.IsLeader && st.Term == term {
		return cur, term
	}
	v.mu.Lock()
	v.unprovoked++
	v.mu.Unlock()
	v.t.Logf("%s lost its leadership of term %d without a fault", cur.id, term)
	return v.nextLeader(term, maxTakeover+2*ttl)
}

// settleFor returns how long a leader leads before a fault: 1.5 TTL and a
// random 0 to maxInjectDelay.
func settleFor() time.Duration {
	return ttl + ttl/2 + rand.N(maxInjectDelay+1)
}

// now reads CLOCK_MONOTONIC, the clock of the histories.
func now(t *testing.T) int64 {
	t.Helper()
	return childproc.Now(t)
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
