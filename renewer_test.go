package leader_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/leadertest"
)

// batchStore is a MemStore that records its RenewBatch calls and can report
// chosen leases lost in them.
type batchStore struct {
	*leadertest.MemStore

	mu      sync.Mutex
	batches [][]string // the names of each RenewBatch call
	renews  int        // Renew calls from outside RenewBatch
	lose    map[string]bool
}

func newBatchStore() *batchStore {
	return &batchStore{MemStore: leadertest.NewMemStore(), lose: map[string]bool{}}
}

func (s *batchStore) Renew(ctx context.Context, name, token string, term uint64, ttl time.Duration) (leader.Lease, error) {
	s.mu.Lock()
	s.renews++
	s.mu.Unlock()
	return s.MemStore.Renew(ctx, name, token, term, ttl)
}

func (s *batchStore) RenewBatch(ctx context.Context, batch []leader.Renewal) {
	names := make([]string, len(batch))
	for i, r := range batch {
		names[i] = r.Name
	}
	slices.Sort(names)
	s.mu.Lock()
	s.batches = append(s.batches, names)
	lose := maps(s.lose)
	s.mu.Unlock()
	s.MemStore.RenewBatch(ctx, batch)
	for i := range batch {
		if r := &batch[i]; lose[r.Name] {
			r.Lease, r.Err = leader.Lease{}, fmt.Errorf("batch store: %q: %w", r.Name, leader.ErrLeaseLost)
		}
	}
}

func maps(m map[string]bool) map[string]bool {
	out := make(map[string]bool, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

// calls returns how many RenewBatch calls there were, and the Renew calls
// made outside them.
func (s *batchStore) calls() (batches, renews int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.batches), s.renews
}

// batchesSince returns the names of each RenewBatch call after the first n.
func (s *batchStore) batchesSince(n int) [][]string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.batches[n:])
}

// leadAll starts an Elector for each name on store, with cfg's settings
// (and then each's own, if each is not nil), and waits until all lead.
func leadAll(t *testing.T, store leader.Store, names []string, cfg leader.Config, each func(name string, c *leader.Config)) map[string]*leader.Elector {
	t.Helper()
	es := map[string]*leader.Elector{}
	for _, name := range names {
		c := cfg
		c.Name, c.ID = name, "id-"+name
		if each != nil {
			each(name, &c)
		}
		e, err := leader.New(store, c)
		if err != nil {
			t.Fatal(err)
		}
		runElector(t, e)
		es[name] = e
	}
	for name, e := range es {
		eventually(t, 3*time.Second, name+" to lead", e.IsLeader)
	}
	return es
}

func TestRenewalRounds(t *testing.T) {
	t.Parallel()

	names := func(prefix string, n int) []string {
		var out []string
		for i := range n {
			out = append(out, fmt.Sprintf("%s-%02d", prefix, i))
		}
		return out
	}
	// waitBatches waits until the store has had n more RenewBatch calls
	// than from, and returns them.
	waitBatches := func(t *testing.T, s *batchStore, from, n int) [][]string {
		t.Helper()
		eventually(t, 5*time.Second, fmt.Sprintf("%d more renew rounds", n), func() bool {
			b, _ := s.calls()
			return b >= from+n
		})
		return s.batchesSince(from)[:n]
	}

	t.Run("the leaders of a process renew with one call per round", func(t *testing.T) {
		t.Parallel()
		s := newBatchStore()
		ns := names("round", 12)
		es := leadAll(t, s, ns, testConfig("", ""), nil)
		// Once a round has renewed every leader, every round holds all of
		// them.
		var from int
		eventually(t, 10*time.Second, "a round that renews every leader", func() bool {
			i := slices.IndexFunc(s.batchesSince(0), func(b []string) bool { return slices.Equal(b, ns) })
			from = i + 1
			return i >= 0
		})
		for i, batch := range waitBatches(t, s, from, 3) {
			if !slices.Equal(batch, ns) {
				t.Errorf("round %d renewed %v; want all %d names in one call", i, batch, len(ns))
			}
		}
		if _, renews := s.calls(); renews != 0 {
			t.Errorf("%d Renew calls besides the batches; want none", renews)
		}
		for name, e := range es {
			if !e.IsLeader() {
				t.Errorf("%s no longer leads", name)
			}
		}
	})

	t.Run("a lease lost in a round ends only its own leadership", func(t *testing.T) {
		t.Parallel()
		s := newBatchStore()
		ns := names("lose", 3)
		ms := map[string]*recordingMetrics{}
		es := leadAll(t, s, ns, testConfig("", ""), func(name string, c *leader.Config) {
			ms[name] = &recordingMetrics{}
			c.Metrics = ms[name]
		})
		lost := ns[1]
		s.mu.Lock()
		s.lose[lost] = true
		s.mu.Unlock()
		eventually(t, 3*time.Second, lost+" to step down", func() bool { return len(ms[lost].losses()) > 0 })
		if got := ms[lost].losses(); !slices.Equal(got, []leader.LossReason{leader.LossExpired}) {
			t.Errorf("%s's losses = %v, want [expired]", lost, got)
		}
		from, _ := s.calls()
		waitBatches(t, s, from, 2)
		for _, name := range []string{ns[0], ns[2]} {
			if got := ms[name].losses(); len(got) != 0 || !es[name].IsLeader() {
				t.Errorf("%s: losses %v, leading %v; want it still leading", name, got, es[name].IsLeader())
			}
		}
	})

	t.Run("a round of thousands of leaders extends every deadline", func(t *testing.T) {
		t.Parallel()
		// Enough leaders that the round's outcomes are applied by several
		// goroutines.
		s := newBatchStore()
		ns := names("many", 2500)
		cfg := testConfig("", "")
		cfg.TTL = 3 * time.Second
		es := leadAll(t, s, ns, cfg, nil)
		time.Sleep(2 * cfg.TTL / 3)
		stops := map[string]time.Time{}
		for name, e := range es {
			stops[name] = e.Status().StopAt
		}
		from, _ := s.calls()
		for _, batch := range waitBatches(t, s, from, 2) {
			if len(batch) != len(ns) {
				t.Errorf("a round renewed %d leases; want all %d", len(batch), len(ns))
			}
		}
		for name, e := range es {
			if st := e.Status(); !st.IsLeader || !st.StopAt.After(stops[name]) {
				t.Fatalf("%s after two rounds: leading %v, stop point %v (was %v); want leading, the stop point later",
					name, st.IsLeader, st.StopAt, stops[name])
			}
		}
	})

	t.Run("a leader that stops leaves the round", func(t *testing.T) {
		t.Parallel()
		s := newBatchStore()
		ns := names("leave", 4)
		cfg := testConfig("", "")
		var stops []func()
		for _, name := range ns {
			c := cfg
			c.Name, c.ID = name, "id-"+name
			e, err := leader.New(s, c)
			if err != nil {
				t.Fatal(err)
			}
			stops = append(stops, runElector(t, e))
			eventually(t, 3*time.Second, name+" to lead", e.IsLeader)
		}
		stops[0]()
		from, _ := s.calls()
		for i, batch := range waitBatches(t, s, from, 2) {
			if !slices.Equal(batch, ns[1:]) {
				t.Errorf("round %d after %s stopped renewed %v; want %v", i, ns[0], batch, ns[1:])
			}
		}
		l, err := s.Observe(t.Context(), ns[0])
		if err != nil || l.Held() {
			t.Errorf("Observe %s after its Elector stopped: %+v, %v; want released", ns[0], l, err)
		}
	})

	t.Run("leaders with different renew intervals renew in rounds of their own", func(t *testing.T) {
		t.Parallel()
		s := newBatchStore()
		slow := testConfig("", "")
		slow.TTL, slow.RenewInterval = 2*time.Second, 600*time.Millisecond
		leadAll(t, s, names("slow", 2), slow, nil)
		leadAll(t, s, names("fast", 2), testConfig("", ""), nil)
		time.Sleep(2 * slow.RenewInterval)
		from, _ := s.calls()
		for i, batch := range waitBatches(t, s, from, 4) {
			if !slices.Equal(batch, names("fast", 2)) && !slices.Equal(batch, names("slow", 2)) {
				t.Errorf("round %d renewed %v; want the fast pair or the slow pair alone", i, batch)
			}
		}
	})
}
