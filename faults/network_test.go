package faults_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/internal/history"
	"github.com/leaderelect/leader/internal/pgtest"
	"github.com/leaderelect/leader/postgres"
)

const (
	election   = "faulty"
	resource   = "leader-output"
	ttl        = 2 * time.Second // RenewInterval TTL/3, about 667 ms
	candidates = 3
	// writeEvery is the pace of each leader's writes to the fenced register.
	writeEvery = 20 * time.Millisecond
	// maxInjectDelay bounds the random wait between a leader's election and
	// the fault.
	maxInjectDelay = 700 * time.Millisecond
	// ciTrials and soakTrials are the trials of each fault on each strategy
	// in one scenario, in CI mode and in each round of soak mode.
	ciTrials   = 2
	soakTrials = 10
)

// toxic is one toxiproxy toxic, in the JSON form ToxicCollection.AddToxicJson
// reads.
type toxic struct {
	Name       string         `json:"name"`
	Type       string         `json:"type"`
	Stream     string         `json:"stream"` // "upstream" (to the server) or "downstream"
	Toxicity   float64        `json:"toxicity"`
	Attributes map[string]any `json:"attributes"`
}

// both returns the toxic of type typ with attrs on both streams.
func both(typ string, attrs map[string]any) []toxic {
	return []toxic{
		{Name: typ + "_up", Type: typ, Stream: "upstream", Toxicity: 1, Attributes: attrs},
		{Name: typ + "_down", Type: typ, Stream: "downstream", Toxicity: 1, Attributes: attrs},
	}
}

// networkFault is a fault of the current leader's connections.
type networkFault struct {
	name   string
	toxics []toxic
	// maxTakeover bounds the takeover, from the end of the old leader's
	// belief to the new leader's OnElected. Generous: the point is to
	// catch a takeover that does not happen, not to benchmark.
	maxTakeover time.Duration
}

var networkFaults = []networkFault{
	{
		// The timeout toxic with timeout 0 drops every byte and never
		// closes the connection: no FIN, no RST.
		name:        "black-hole",
		toxics:      both("timeout", map[string]any{"timeout": 0}),
		maxTakeover: 3 * ttl,
	},
	{
		// reset_peer closes with SO_LINGER 0, which sends RST, both to
		// the client and to the server, at the first byte either sends.
		// (Disabling the proxy would close with FIN.)
		name:        "reset",
		toxics:      both("reset_peer", map[string]any{"timeout": 0}),
		maxTakeover: 3 * ttl,
	},
	{
		// 2.5 s each way: every renewal's answer comes after the
		// Elector's local deadline. delayToxic is toxiproxy's latency
		// toxic without its goroutine leak.
		name:        "delay",
		toxics:      both(delayToxicType, map[string]any{"latency": 2500}),
		maxTakeover: 3 * ttl,
	},
}

// Every network fault on every strategy, a few times each in CI mode, for
// as long as LEADER_SOAK says in soak mode. See the package documentation.
func TestNetworkFaults(t *testing.T) {
	t.Parallel()
	rounds(t, ciTrials, soakTrials, func(t *testing.T, trials int) {
		for _, f := range networkFaults {
			for _, strategy := range strategies {
				t.Run(fmt.Sprintf("the %s store keeps one leader when the leader's connections suffer a %s", strategy, f.name), func(t *testing.T) {
					t.Parallel()
					record(t, f.name, strategy, runScenario(t, f, strategy, trials))
				})
			}
		}
	})
}

// candidate is one Elector of a scenario, with the proxy in front of its
// connections.
type candidate struct {
	id    string
	e     *leader.Elector
	rec   *history.Recorder
	stop  func()
	proxy *toxiproxy.Proxy // replaced by heal
	// addr is the proxy's address, which the candidate's connections
	// dial: heal starts the new proxy on a port of its own.
	addr atomic.Pointer[string]
}

// scenario is one fault on one strategy, over several trials.
type scenario struct {
	fault      networkFault
	connString string
	proxies    *toxiproxy.ApiServer
	upstream   string
	cands      []*candidate
	workPool   *pgxpool.Pool // straight to the server, never faulty
	fence      *fence        // on workPool
}

// runScenario runs trials of fault f on the strategy's store and checks the
// histories.
func runScenario(t *testing.T, f networkFault, strategy string, trials int) result {
	connString := pgtest.NewDatabase(t)
	s := &scenario{
		fault:      f,
		connString: connString,
		proxies:    toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop()),
		upstream:   serverAddr(t, connString),
		workPool:   pgtest.OpenPool(t, connString),
	}
	ctx := callCtx(t)
	if err := postgres.Migrate(ctx, s.workPool, postgres.Options{}); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	s.fence = setupFence(t, s.workPool)
	dir := t.TempDir()
	for i := range candidates {
		s.cands = append(s.cands, s.newCandidate(t, dir, strategy, fmt.Sprint("e", i)))
	}

	var faultedTerms []uint64
	cur, term := s.nextLeader(t, 0, 10*time.Second)
	for trial := range trials {
		// The fault's timing relative to the renewals, at random.
		time.Sleep(rand.N(maxInjectDelay + 1))
		faultedTerms = append(faultedTerms, term)
		s.inject(t, cur)
		next, nextTerm := s.nextLeader(t, term, f.maxTakeover+2*ttl)
		if cur.e.IsLeader() {
			t.Errorf("trial %d: %s still believes it leads with term %d after %s was elected with term %d", trial, cur.id, term, next.id, nextTerm)
		}
		s.fence.lateWrite(t, trial, cur.id, term, nextTerm)
		s.heal(t, cur)
		cur, term = next, nextTerm
	}

	var wg sync.WaitGroup
	for _, c := range s.cands {
		wg.Go(c.stop)
	}
	wg.Wait()
	for _, c := range s.cands {
		if err := c.rec.Close(); err != nil {
			t.Fatalf("%s: %v", c.id, err)
		}
	}
	return s.check(t, dir, faultedTerms)
}

// check checks the histories of beliefs and of the register, and returns the
// scenario's result. Takeovers are counted only from the faulted leaders:
// the handovers when the scenario stops its Electors are not the fault's.
func (s *scenario) check(t *testing.T, dir string, faultedTerms []uint64) result {
	evs, err := history.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	rep := checkBeliefs(t, evs, history.Bounds{MaxTakeover: s.fault.maxTakeover})
	r := result{trials: len(faultedTerms), overlaps: len(rep.Overlaps), termRegressions: len(rep.TermRegressions)}
	for _, tk := range rep.Takeovers {
		if slices.Contains(faultedTerms, tk.From.Term) {
			r.takeovers = append(r.takeovers, tk.Gap)
		}
	}
	if len(r.takeovers) != len(faultedTerms) {
		t.Errorf("%d takeovers from the %d faulted leaders (terms %v):\n%v", len(r.takeovers), len(faultedTerms), faultedTerms, rep)
	}

	accepted, refused, stale := s.fence.check(t)
	r.staleRefused, r.staleAccepted = refused, stale
	t.Logf("takeovers %v; fenced register: %d writes accepted, %d refused", history.Summarize(r.takeovers), accepted, refused)
	return r
}

// newCandidate starts an Elector for id on its own proxy, pool and store.
func (s *scenario) newCandidate(t *testing.T, dir, strategy, id string) *candidate {
	t.Helper()
	c := &candidate{id: id, proxy: toxiproxy.NewProxy(s.proxies, id, "127.0.0.1:0", s.upstream)}
	if err := c.proxy.Start(); err != nil {
		t.Fatalf("%s: starting the proxy: %v", id, err)
	}
	addr := c.proxy.Listen
	c.addr.Store(&addr)
	// The proxy is replaced by heal: stop whichever is current.
	t.Cleanup(func() { c.proxy.Stop() })
	pool := poolVia(t, s.connString, func() string { return *c.addr.Load() })
	store := newStore(t, strategy, pool)

	c.e, c.rec, c.stop = s.fence.startElector(t, dir, id, store, ttl, nil)
	return c
}

// nextLeader waits for a leader with a term above after that has had a few
// writes accepted.
func (s *scenario) nextLeader(t *testing.T, after uint64, within time.Duration) (*candidate, uint64) {
	t.Helper()
	var cur *candidate
	var term uint64
	electortest.Eventually(t, within, fmt.Sprintf("a leader with a term above %d that has written", after), func() bool {
		for _, c := range s.cands {
			if st := c.e.Status(); st.IsLeader && st.Term > after && s.fence.written(st.Term) >= 3 {
				cur, term = c, st.Term
				return true
			}
		}
		return false
	})
	return cur, term
}

// inject breaks c's connections, those open and those to come.
func (s *scenario) inject(t *testing.T, c *candidate) {
	t.Helper()
	for _, tx := range s.fault.toxics {
		js, err := json.Marshal(tx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.proxy.Toxics.AddToxicJson(bytes.NewReader(js)); err != nil {
			t.Fatalf("%s: adding toxic %s: %v", c.id, tx.Name, err)
		}
	}
}

// heal ends the fault of c's connections: it stops c's proxy, which closes
// every connection through it, and starts a new one without toxics, on a
// port of its own (the old one's may have been taken meanwhile), which
// c's connections dial from then on. (Removing the toxics instead can
// hang in toxiproxy v2.12 when a link's connection is already gone.)
func (s *scenario) heal(t *testing.T, c *candidate) {
	t.Helper()
	c.proxy.Stop()
	fresh := toxiproxy.NewProxy(s.proxies, c.id, "127.0.0.1:0", s.upstream)
	if err := fresh.Start(); err != nil {
		t.Fatalf("%s: starting a new proxy: %v", c.id, err)
	}
	c.proxy = fresh
	addr := fresh.Listen
	c.addr.Store(&addr)
}

// serverAddr returns the host:port of the server connString names.
func serverAddr(t *testing.T, connString string) string {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(connString)
	if err != nil {
		t.Fatal(err)
	}
	if strings.HasPrefix(cfg.ConnConfig.Host, "/") {
		t.Fatalf("the test server is reached through a Unix socket (%s); the proxies need TCP", cfg.ConnConfig.Host)
	}
	return net.JoinHostPort(cfg.ConnConfig.Host, strconv.Itoa(int(cfg.ConnConfig.Port)))
}

// poolVia returns a pool for the scenario's database whose connections,
// and those of the stores on it, go through the proxy listening on the
// address proxyAddr returns at each dial; the pool is closed when t ends.
func poolVia(t *testing.T, connString string, proxyAddr func() string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(connString)
	if err != nil {
		t.Fatal(err)
	}
	host, port, err := net.SplitHostPort(proxyAddr())
	if err != nil {
		t.Fatal(err)
	}
	p, err := strconv.ParseUint(port, 10, 16)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.Host = host
	cfg.ConnConfig.Port = uint16(p)
	cfg.ConnConfig.Fallbacks = nil
	var d net.Dialer
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, _ string) (net.Conn, error) {
		return d.DialContext(ctx, network, proxyAddr())
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}
