package leader_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/leadertest"
)

// transferGroup is a group of Electors for one name on one MemStore, whose
// history fails the test if two ever lead at once or a term goes back.
type transferGroup struct {
	store *leadertest.MemStore
	name  string
	h     *electortest.History
	es    map[string]*leader.Elector
	// tune, if set, changes the Config of each Elector that start starts.
	tune func(*leader.Config)
	// stops ends the Run of each Elector, by ID.
	stops map[string]func()
}

func newTransferGroup(t *testing.T, name string, priorities map[string]int) *transferGroup {
	g := &transferGroup{store: leadertest.NewMemStore(), name: name, es: map[string]*leader.Elector{}}
	g.h = newHistory()
	for id, p := range priorities {
		g.start(t, id, p)
	}
	return g
}

// start starts a candidate id with priority p.
func (g *transferGroup) start(t *testing.T, id string, p int) *leader.Elector {
	t.Helper()
	cfg := testConfig(g.name, id)
	cfg.Priority = p
	cfg.OnElected, cfg.OnDemoted = g.h.Hooks(t, id)
	if g.tune != nil {
		g.tune(&cfg)
	}
	e, err := leader.New(g.store, cfg)
	if err != nil {
		t.Fatal(err)
	}
	g.es[id] = e
	if g.stops == nil {
		g.stops = map[string]func(){}
	}
	g.stops[id] = runElector(t, e)
	return e
}

// leader waits for one Elector of the group to lead and returns its ID and
// term.
func (g *transferGroup) leader(t *testing.T) (string, uint64) {
	t.Helper()
	var id string
	var term uint64
	eventually(t, 10*time.Second, "a leader", func() bool {
		for i, e := range g.es {
			if st := e.Status(); st.IsLeader {
				id, term = i, st.Term
				return true
			}
		}
		return false
	})
	return id, term
}

// enlisted waits until every Elector of the group but the leader is among
// the store's candidates.
func (g *transferGroup) enlisted(t *testing.T) {
	t.Helper()
	eventually(t, 10*time.Second, "every follower enlisted", func() bool {
		cands, err := g.store.Candidates(t.Context(), g.name)
		return err == nil && len(cands) >= len(g.es)-1
	})
}

// enlistCounter counts the Enlist calls made of a Transferer.
type enlistCounter struct {
	leader.Transferer
	enlists atomic.Int64
}

func (c *enlistCounter) Enlist(ctx context.Context, name string, cand leader.Candidate, ttl time.Duration) error {
	c.enlists.Add(1)
	return c.Transferer.Enlist(ctx, name, cand, ttl)
}

func callCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func TestTransfer(t *testing.T) {
	t.Parallel()

	t.Run("the leader hands over to the named candidate, which leads at once with the next term", func(t *testing.T) {
		t.Parallel()
		g := newTransferGroup(t, "named", map[string]int{"a": 0, "b": 0, "c": 0})
		from, term := g.leader(t)
		g.enlisted(t)
		to := map[string]string{"a": "b", "b": "c", "c": "a"}[from]
		l, err := g.es[from].Transfer(callCtx(t), to)
		if err != nil {
			t.Fatalf("Transfer to %s: %v", to, err)
		}
		if l.HolderID != to || l.Term != term+1 || l.Reason != leader.GrantTransfer {
			t.Fatalf("Transfer returned %+v; want held by %s with term %d, reason transfer", l, to, term+1)
		}
		// The old leader was demoted before the successor was elected
		// (the history checks it), and nobody else led in between.
		// Transfer returns once the store shows the successor's grant;
		// the successor's Elector counts itself leader, and runs
		// OnElected, a moment later.
		eventually(t, 10*time.Second, fmt.Sprintf("%s's OnElected with term %d", to, term+1), func() bool {
			els := g.h.Elections()
			last := els[len(els)-1]
			return last.Instance == to && last.Term == term+1
		})
		if st := g.es[to].Status(); !st.IsLeader || st.Term != term+1 || st.Reason != leader.GrantTransfer {
			t.Fatalf("the successor's Status = %+v; want leading with term %d, reason transfer", st, term+1)
		}
		if els := g.h.Elections(); len(els) != 2 {
			t.Fatalf("elections %v; want two: %s's, then %s's", els, from, to)
		}
	})

	t.Run("a transfer to a candidate that does not campaign fails and changes nothing", func(t *testing.T) {
		t.Parallel()
		g := newTransferGroup(t, "gone", map[string]int{"a": 0, "b": 0})
		from, term := g.leader(t)
		g.enlisted(t)
		_, err := g.es[from].Transfer(callCtx(t), "nobody")
		if !errors.Is(err, leader.ErrNoCandidate) {
			t.Fatalf("Transfer to a candidate that does not campaign: %v; want ErrNoCandidate", err)
		}
		if st := g.es[from].Status(); !st.IsLeader || st.Term != term {
			t.Fatalf("after a refused transfer the leader's Status = %+v; want still leading with term %d", st, term)
		}
		_, err = leader.RequestTransfer(callCtx(t), g.store, g.name, "nobody")
		if !errors.Is(err, leader.ErrNoCandidate) {
			t.Fatalf("RequestTransfer to a candidate that does not campaign: %v; want ErrNoCandidate", err)
		}
	})

	t.Run("a successor that never takes the lease lets it go to the others after one RenewInterval", func(t *testing.T) {
		t.Parallel()
		// TTL 6s: the reservation lasts a RenewInterval, 2s.
		g := &transferGroup{store: leadertest.NewMemStore(), name: "silent", es: map[string]*leader.Elector{}, h: newHistory()}
		g.tune = func(c *leader.Config) { c.TTL = 6 * time.Second }
		g.start(t, "a", 0)
		g.start(t, "b", 0)
		from, term := g.leader(t)
		g.enlisted(t)
		ghost := leader.Candidate{ID: "ghost", Token: "ghost-token"}
		if err := g.store.Enlist(t.Context(), g.name, ghost, time.Minute); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		_, err := g.es[from].Transfer(callCtx(t), "ghost")
		if !errors.Is(err, leader.ErrTransferNotTaken) {
			t.Fatalf("Transfer to a candidate that never takes the lease: %v; want ErrTransferNotTaken", err)
		}
		if took := time.Since(start); took < 1500*time.Millisecond || took > 4*time.Second {
			t.Errorf("Transfer gave up on the successor after %v; its reservation lasts a RenewInterval (2s), not a TTL (6s)", took)
		}
		id, next := g.leader(t)
		if next <= term {
			t.Fatalf("%s leads with term %d after term %d", id, next, term)
		}
		if st := g.es[id].Status(); st.Reason != leader.GrantRelease {
			t.Errorf("the lease was taken after the reservation ran out with reason %q; want release", st.Reason)
		}
	})

	t.Run("a lease handed back to a candidate that lost it a moment ago is taken at once, not after its sit-out", func(t *testing.T) {
		t.Parallel()
		// After a loss an Elector sits out RetryInterval (5s here) before
		// it campaigns again, ignoring releases meanwhile: they are its
		// own. A release reserved for it is not.
		g := &transferGroup{store: leadertest.NewMemStore(), name: "back", es: map[string]*leader.Elector{}, h: newHistory()}
		g.tune = func(c *leader.Config) { c.TTL, c.RetryInterval = 15*time.Second, 5*time.Second }
		g.start(t, "a", 0)
		g.start(t, "b", 0)
		from, term := g.leader(t)
		g.enlisted(t)
		to := map[string]string{"a": "b", "b": "a"}[from]
		if _, err := g.es[from].Transfer(callCtx(t), to); err != nil {
			t.Fatalf("Transfer to %s: %v", to, err)
		}
		stepped := time.Now()
		// It enlists again half a RetryInterval into its sit-out.
		eventually(t, 10*time.Second, from+" enlisted again", func() bool {
			cands, err := g.store.Candidates(t.Context(), g.name)
			return err == nil && slices.ContainsFunc(cands, func(c leader.Candidate) bool { return c.ID == from })
		})
		start := time.Now()
		l, err := g.es[to].Transfer(callCtx(t), from)
		if err != nil || l.HolderID != from || l.Term != term+2 {
			t.Fatalf("Transfer back to %s = %+v, %v; want held by %s with term %d", from, l, err, from, term+2)
		}
		if took := time.Since(start); took > 1500*time.Millisecond {
			t.Errorf("handing the lease back %v after %s stepped down took %v: it waited out its sit-out (5s) instead of taking it at once", start.Sub(stepped), from, took)
		}
	})

	t.Run("with HandOverOnStop, a leader whose Run ends hands over to the best candidate and campaigns no more", func(t *testing.T) {
		t.Parallel()
		g := &transferGroup{store: leadertest.NewMemStore(), name: "stop", es: map[string]*leader.Elector{}, h: newHistory()}
		g.tune = func(c *leader.Config) { c.HandOverOnStop = true }
		g.start(t, "a", 5)
		_, term := g.leader(t)
		g.start(t, "b", 3)
		g.start(t, "c", 4)
		g.enlisted(t)
		g.stops["a"]() // Run returns once the lease is handed over
		eventually(t, 5*time.Second, "c to lead", func() bool { return g.es["c"].IsLeader() })
		if st := g.es["c"].Status(); st.Term != term+1 || st.Reason != leader.GrantTransfer {
			t.Fatalf("after a's Run ended, c's Status = %+v; want term %d, reason transfer (c's priority 4 is the best left)", st, term+1)
		}
		cands, err := g.store.Candidates(t.Context(), g.name)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range cands {
			if c.ID == "a" {
				t.Errorf("a is still among the candidates after its Run ended: %+v", cands)
			}
		}
		eventually(t, 5*time.Second, "c's OnElected", func() bool { return len(g.h.Elections()) >= 2 })
		if els := g.h.Elections(); len(els) != 2 || els[1].Instance != "c" {
			t.Fatalf("elections %v; want a's, then c's", els)
		}
	})

	t.Run("with HandOverOnStop and no other candidate, Run releases as usual", func(t *testing.T) {
		t.Parallel()
		g := &transferGroup{store: leadertest.NewMemStore(), name: "alone", es: map[string]*leader.Elector{}, h: newHistory()}
		g.tune = func(c *leader.Config) { c.HandOverOnStop = true }
		g.start(t, "a", 0)
		_, term := g.leader(t)
		g.stops["a"]()
		l, err := g.store.Observe(t.Context(), g.name)
		if err != nil || l.Held() || l.Term != term || l.Reserved != 0 {
			t.Fatalf("after the only candidate's Run ended, the lease is %+v, %v; want released, not reserved, term %d", l, err, term)
		}
	})

	t.Run("a follower whose attempts come every TTL is enlisted by them, without calling Enlist", func(t *testing.T) {
		t.Parallel()
		mem := leadertest.NewMemStore()
		counted := &enlistCounter{Transferer: mem}
		store := transferFaultStore{newFaultStore(mem), counted}
		for _, id := range []string{"a", "b"} {
			e, err := leader.New(store, testConfig("enlist", id))
			if err != nil {
				t.Fatal(err)
			}
			runElector(t, e)
		}
		time.Sleep(3500 * time.Millisecond) // over 3 TTLs: an entry made once would have run out
		cands, err := mem.Candidates(t.Context(), "enlist")
		if err != nil || len(cands) != 1 {
			t.Fatalf("Candidates = %v, %v; want the follower", cands, err)
		}
		if n := counted.enlists.Load(); n != 0 {
			t.Errorf("the follower called Enlist %d times; want none: its attempts, once per TTL, enlist it", n)
		}
	})

	t.Run("any process can ask the leader to hand over, without an Elector", func(t *testing.T) {
		t.Parallel()
		g := newTransferGroup(t, "request", map[string]int{"a": 0, "b": 0, "c": 0})
		from, term := g.leader(t)
		g.enlisted(t)
		to := map[string]string{"a": "c", "b": "a", "c": "b"}[from]
		l, err := leader.RequestTransfer(callCtx(t), g.store, g.name, to)
		if err != nil {
			t.Fatalf("RequestTransfer to %s: %v", to, err)
		}
		if l.HolderID != to || l.Term != term+1 || l.Reason != leader.GrantTransfer {
			t.Fatalf("RequestTransfer returned %+v; want held by %s with term %d", l, to, term+1)
		}
		// An Elector's Transfer hands over its own leadership only.
		other := map[string]string{"a": "b", "b": "c", "c": "a"}[to]
		if _, err := g.es[other].Transfer(callCtx(t), ""); !errors.Is(err, leader.ErrNotLeader) {
			t.Fatalf("a follower's Transfer: %v; want ErrNotLeader", err)
		}
	})

	t.Run("without a candidate ID the leader hands over to the highest priority", func(t *testing.T) {
		t.Parallel()
		g := newTransferGroup(t, "best", map[string]int{"a": 0})
		g.leader(t)
		g.start(t, "b", -1) // lower than the leader: never asks
		g.start(t, "c", -2)
		g.enlisted(t)
		l, err := g.es["a"].Transfer(callCtx(t), "")
		if err != nil || l.HolderID != "b" {
			t.Fatalf("Transfer to the best = %+v, %v; want held by b (priority -1 beats -2)", l, err)
		}
	})

	t.Run("concurrent requests hand over once, to one of the candidates asked for", func(t *testing.T) {
		t.Parallel()
		g := newTransferGroup(t, "concurrent", map[string]int{"a": 0, "b": 0, "c": 0, "d": 0})
		from, term := g.leader(t)
		g.enlisted(t)
		var wg sync.WaitGroup
		results := make(chan error, 3)
		for id := range g.es {
			if id == from {
				continue
			}
			wg.Go(func() {
				_, err := leader.RequestTransfer(callCtx(t), g.store, g.name, id)
				results <- err
			})
		}
		wg.Wait()
		close(results)
		ok := 0
		for err := range results {
			switch {
			case err == nil:
				ok++
			case errors.Is(err, leader.ErrTransferNotTaken):
				// Another request was recorded after this one.
			default:
				t.Errorf("RequestTransfer: %v", err)
			}
		}
		if ok != 1 {
			t.Errorf("%d of 3 concurrent requests succeeded; want 1", ok)
		}
		l, err := g.store.Observe(t.Context(), g.name)
		if err != nil || l.Term != term+1 || l.HolderID == from {
			t.Fatalf("after concurrent requests the lease is %+v, %v; want handed over once, with term %d", l, err, term+1)
		}
	})

	t.Run("a candidate with a higher priority takes over after the minimum tenure, and equals never move it", func(t *testing.T) {
		t.Parallel()
		g := newTransferGroup(t, "priority", nil)
		// A TTL of 5 s, so that no stall of a busy machine loses the lease
		// meanwhile (which would move leadership for another reason), and
		// a MinTenure of 1 s.
		g.tune = func(cfg *leader.Config) { cfg.TTL, cfg.MinTenure = 5*time.Second, time.Second }
		g.start(t, "old", 1)
		_, term := g.leader(t)
		g.start(t, "new1", 2)
		// Its OnElected, which records the election, runs after IsLeader
		// turns true: wait for both.
		eventually(t, 10*time.Second, "new1 to lead", func() bool {
			_, elected := g.h.Find(func(e event) bool { return e.Instance == "new1" && e.Elected })
			return g.es["new1"].IsLeader() && elected
		})
		st := g.es["new1"].Status()
		if st.Term != term+1 || st.Reason != leader.GrantPriority {
			t.Fatalf("new1's Status = %+v; want term %d, reason priority", st, term+1)
		}
		e, ok := g.h.Find(func(e event) bool { return e.Instance == "new1" && e.Elected })
		first, _ := g.h.Find(func(e event) bool { return e.Instance == "old" && e.Elected })
		if !ok || e.At.Sub(first.At) < time.Second {
			t.Errorf("new1 was elected %v after old; want no sooner than old's MinTenure (1s)", e.At.Sub(first.At))
		}
		// An equal priority, and a lower one, never move leadership.
		g.start(t, "new2", 2)
		g.start(t, "old2", 1)
		time.Sleep(3 * time.Second) // several MinTenures and renewals
		if st := g.es["new1"].Status(); !st.IsLeader || st.Term != term+1 {
			t.Fatalf("with an equal and a lower priority campaigning, new1's Status = %+v; want still leading with term %d", st, term+1)
		}
		if n := len(g.h.Elections()); n != 2 {
			t.Fatalf("%d elections: %v; want 2", n, g.h.Elections())
		}
	})
}

func TestTransferConfig(t *testing.T) {
	for _, tc := range []struct {
		cfg   func(*leader.Config)
		field string
	}{
		{func(c *leader.Config) { c.Priority = leader.MaxPriority + 1 }, "Priority"},
		{func(c *leader.Config) { c.Priority = leader.MinPriority - 1 }, "Priority"},
		{func(c *leader.Config) { c.MinTenure = -time.Second }, "MinTenure"},
		{func(c *leader.Config) { c.MinTenure = leader.MaxTTL + 1 }, "MinTenure"},
	} {
		cfg := testConfig("cfg", "a")
		tc.cfg(&cfg)
		_, err := leader.New(leadertest.NewMemStore(), cfg)
		var ce *leader.ConfigError
		if !errors.As(err, &ce) || ce.Field != tc.field {
			t.Errorf("New with %s out of bounds: %v; want a ConfigError for %s", tc.field, err, tc.field)
		}
	}
	if e, err := leader.New(leadertest.NewMemStore(), testConfig("cfg", "a")); err != nil || e.Config().MinTenure != time.Second {
		t.Errorf("default MinTenure = %v (%v); want the TTL, 1s", e.Config().MinTenure, err)
	}
}

// acquireCounter counts the Acquire calls made of a MemStore, keeping the
// store's optional interfaces (HandoverWatcher among them).
type acquireCounter struct {
	*leadertest.MemStore
	acquires atomic.Int64
}

func (c *acquireCounter) Acquire(ctx context.Context, name string, cand leader.Candidate, ttl time.Duration) (leader.Lease, bool, error) {
	c.acquires.Add(1)
	return c.MemStore.Acquire(ctx, name, cand, ttl)
}

// TestTransferWakesOnlyTheSuccessor checks that on a store that is a
// HandoverWatcher, a transfer costs the followers other than the successor
// no attempt: they watch with WatchFreeFor, which the handover does not
// wake.
func TestTransferWakesOnlyTheSuccessor(t *testing.T) {
	t.Parallel()
	store := leadertest.NewMemStore()
	h := newHistory()
	ids := []string{"a", "b", "c", "d"}
	es := map[string]*leader.Elector{}
	counts := map[string]*acquireCounter{}
	for _, id := range ids {
		counts[id] = &acquireCounter{MemStore: store}
		// A long TTL: no follower's attempt falls due during the test
		// but for a wake-up.
		cfg := testConfig("wakes", id)
		cfg.TTL = 30 * time.Second
		cfg.OnElected, cfg.OnDemoted = h.Hooks(t, id)
		e, err := leader.New(counts[id], cfg)
		if err != nil {
			t.Fatal(err)
		}
		es[id] = e
		runElector(t, e)
	}
	var from string
	eventually(t, 10*time.Second, "a leader, and every follower enlisted", func() bool {
		from = ""
		for id, e := range es {
			if e.Status().IsLeader {
				from = id
			}
		}
		cands, err := store.Candidates(t.Context(), "wakes")
		return from != "" && err == nil && len(cands) == len(ids)-1
	})
	to := map[string]string{"a": "b", "b": "c", "c": "d", "d": "a"}[from]
	before := map[string]int64{}
	for id, c := range counts {
		before[id] = c.acquires.Load()
	}
	if _, err := es[from].Transfer(callCtx(t), to); err != nil {
		t.Fatalf("Transfer from %s to %s: %v", from, to, err)
	}
	// A follower woken by the handover would try within moments.
	time.Sleep(300 * time.Millisecond)
	for _, id := range ids {
		if id == from || id == to {
			continue
		}
		if n := counts[id].acquires.Load() - before[id]; n != 0 {
			t.Errorf("follower %s made %d attempts during a transfer from %s to %s; want none", id, n, from, to)
		}
	}
	if n := counts[to].acquires.Load() - before[to]; n != 1 {
		t.Errorf("the successor %s made %d attempts; want 1", to, n)
	}
}
