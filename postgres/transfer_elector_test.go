package postgres_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/postgres"
)

// These tests hand leadership over between Electors on a real server, on
// both strategies, each Elector on a store of its own (as in a process of
// its own). The history fails a test if two ever lead at once or a term
// goes back.

// transferStore is a store of either strategy, with its transfers.
type transferStore interface {
	leader.Store
	leader.Transferer
}

// newTransferStore returns a store of strategy on pool, closed when t
// ends.
func newTransferStore(t testing.TB, strategy postgres.Strategy, pool *pgxpool.Pool) transferStore {
	t.Helper()
	if strategy == postgres.StrategyAdvisory {
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		defer cancel()
		s, err := postgres.NewAdvisoryStore(ctx, pool, postgres.Options{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(s.Close)
		return s
	}
	s, err := postgres.NewLeaseStore(pool, postgres.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

// transferGroup is a group of Electors of one name, each on a store of
// its own, recording their leadership in one history.
type transferGroup struct {
	s        electionSetup
	strategy postgres.Strategy
	name     string
	ttl      time.Duration
	es       map[string]*leader.Elector
	stores   map[string]transferStore
}

func newTransferGroup(t *testing.T, strategy postgres.Strategy, name string, ttl time.Duration) *transferGroup {
	return &transferGroup{s: newElection(t), strategy: strategy, name: name, ttl: ttl,
		es: map[string]*leader.Elector{}, stores: map[string]transferStore{}}
}

// start starts the Elector id with priority p. Its RetryInterval is
// short: an Elector that lost the lease sits it out before it takes the
// lease again, even when the lease is handed to it, and the tests hand
// leadership back and forth.
func (g *transferGroup) start(t *testing.T, id string, p int) {
	t.Helper()
	store := newTransferStore(t, g.strategy, g.s.pool)
	e := g.s.elector(t, store, g.name, id, id, g.ttl, func(c *leader.Config) {
		c.Priority, c.RetryInterval = p, 100*time.Millisecond
	})
	g.es[id], g.stores[id] = e, store
	electortest.Run(t, e)
}

// leader waits for one Elector of the group to lead, and returns its ID
// and term.
func (g *transferGroup) leader(t *testing.T) (string, uint64) {
	t.Helper()
	var (
		id   string
		term uint64
	)
	electortest.Eventually(t, 15*time.Second, "a leader", func() bool {
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
// the candidates.
func (g *transferGroup) enlisted(t *testing.T, leaderID string) {
	t.Helper()
	var want []string
	for id := range g.es {
		if id != leaderID {
			want = append(want, id)
		}
	}
	electortest.Eventually(t, 2*g.ttl, fmt.Sprintf("%v enlisted", want), func() bool {
		cands, err := g.stores[leaderID].Candidates(t.Context(), g.name)
		if err != nil {
			t.Fatal(err)
		}
		for _, id := range want {
			if !slices.ContainsFunc(cands, func(c leader.Candidate) bool { return c.ID == id }) {
				return false
			}
		}
		return true
	})
}

// checkSuccessor checks that l, as a handover to id of term returned it, and
// every Elector of the group agree that id leads with term+1 for reason.
func (g *transferGroup) checkSuccessor(t *testing.T, what string, l leader.Lease, id string, term uint64, reason leader.GrantReason) {
	t.Helper()
	if l.HolderID != id || l.Term != term+1 || l.Reason != reason {
		t.Fatalf("%s returned %+v; want held by %s with term %d, reason %q", what, l, id, term+1, reason)
	}
	electortest.Eventually(t, 10*time.Second, id+"'s OnElected with term "+fmt.Sprint(term+1), func() bool {
		els := g.s.history.Elections()
		last := els[len(els)-1]
		return last.Instance == id && last.Term == term+1
	})
	if st := g.es[id].Status(); !st.IsLeader || st.Term != term+1 || st.Reason != reason {
		t.Fatalf("after %s the successor's Status = %+v; want leading with term %d, reason %q", what, st, term+1, reason)
	}
}

func TestTransfersOnPostgres(t *testing.T) {
	t.Parallel()
	for _, strategy := range []postgres.Strategy{postgres.StrategyLease, postgres.StrategyAdvisory} {
		t.Run(string(strategy), func(t *testing.T) {
			t.Parallel()
			testTransfers(t, strategy)
		})
	}
}

func testTransfers(t *testing.T, strategy postgres.Strategy) {
	t.Run("Elector.Transfer hands over to the named candidate, which leads with the next term while the others wait", func(t *testing.T) {
		t.Parallel()
		// A TTL far longer than a handover: one that waited for the
		// lease to run out would show.
		const ttl = 10 * time.Second
		g := newTransferGroup(t, strategy, "transfer", ttl)
		for _, id := range []string{"a", "b", "c"} {
			g.start(t, id, 0)
		}
		var took []time.Duration
		for range 3 {
			from, term := g.leader(t)
			g.enlisted(t, from)
			to := map[string]string{"a": "b", "b": "c", "c": "a"}[from]
			elections := len(g.s.history.Elections())
			start := time.Now()
			l, err := g.es[from].Transfer(t.Context(), to)
			took = append(took, time.Since(start))
			if err != nil {
				t.Fatalf("Transfer from %s to %s: %v", from, to, err)
			}
			g.checkSuccessor(t, fmt.Sprintf("Transfer from %s to %s", from, to), l, to, term, leader.GrantTransfer)
			if n := len(g.s.history.Elections()); n != elections+1 {
				t.Fatalf("%d elections in the handover from %s to %s; want the successor's alone", n-elections, from, to)
			}
		}
		electortest.Never(t, 300*time.Millisecond, "another election", func() bool { return len(g.s.history.Elections()) != 4 })
		t.Logf("Transfer calls (the leader's step-down, the handover, and the successor seen leading): %v", took)
		for _, d := range took {
			if d > ttl/5 {
				t.Errorf("a handover took %v with a %v TTL: the successor was not woken", d, ttl)
			}
		}
	})

	t.Run("a fenced write in OnDemoted commits under the old term, before the successor leads, and the handover stays one", func(t *testing.T) {
		// OnDemoted winds the old term's work down with a fenced write,
		// as a leader run child's SIGTERM handler may. A release staged
		// before OnDemoted holds the lease row until its commit, after
		// OnDemoted: the write must not wait for it (it would wait for
		// its own release, until a timeout turned the handover into a
		// takeover). That the write lands before the successor's
		// election follows from the Elector's order; it is checked all
		// the same.
		t.Parallel()
		const ttl = 10 * time.Second
		g := newTransferGroup(t, strategy, "fenced", ttl)
		if _, err := g.s.pool.Exec(t.Context(), "CREATE TABLE wound_down (term bigint, id text)"); err != nil {
			t.Fatal(err)
		}
		type written struct {
			term uint64
			took time.Duration
			err  error
		}
		wrote := make(chan written, 8)
		sawWrite := make(chan bool, 8) // each successor's OnElected: was its predecessor's write there?
		for _, id := range []string{"a", "b"} {
			store := newTransferStore(t, g.strategy, g.s.pool)
			var term atomic.Uint64
			e := g.s.elector(t, store, g.name, id, id, g.ttl, func(c *leader.Config) {
				c.RetryInterval = 100 * time.Millisecond
				elected, demoted := c.OnElected, c.OnDemoted
				c.OnElected = func(ctx context.Context) {
					tm, _ := leader.TermFrom(ctx)
					if term.Swap(tm); tm > 1 {
						var n int
						err := g.s.pool.QueryRow(t.Context(), "SELECT count(*) FROM wound_down WHERE term = $1", int64(tm-1)).Scan(&n)
						sawWrite <- err == nil && n == 1
					}
					elected(ctx)
				}
				c.OnDemoted = func() {
					start := time.Now()
					ctx, cancel := context.WithTimeout(context.Background(), ttl/2)
					defer cancel()
					tm := term.Load()
					err := pgx.BeginFunc(ctx, g.s.pool, func(tx pgx.Tx) error {
						if err := postgres.Fence(ctx, tx, postgres.Options{}, g.name, tm); err != nil {
							return err
						}
						_, err := tx.Exec(ctx, "INSERT INTO wound_down VALUES ($1, $2)", int64(tm), id)
						return err
					})
					wrote <- written{tm, time.Since(start), err}
					demoted()
				}
			})
			g.es[id], g.stores[id] = e, store
			electortest.Run(t, e)
		}
		for range 2 {
			from, term := g.leader(t)
			g.enlisted(t, from)
			to := map[string]string{"a": "b", "b": "a"}[from]
			start := time.Now()
			l, err := g.es[from].Transfer(t.Context(), to)
			if err != nil {
				t.Fatalf("Transfer from %s to %s: %v", from, to, err)
			}
			took := time.Since(start)
			g.checkSuccessor(t, fmt.Sprintf("Transfer from %s to %s", from, to), l, to, term, leader.GrantTransfer)
			w := <-wrote
			if w.err != nil || w.term != term {
				t.Fatalf("%s's fenced write in OnDemoted under term %d: %v (term %d, took %v); want it committed", from, term, w.err, w.term, w.took)
			}
			if !<-sawWrite {
				t.Fatalf("%s was elected before %s's fenced write of term %d had committed", to, from, term)
			}
			if took > ttl/5 {
				t.Errorf("the handover from %s took %v with a %v TTL (its fenced write %v): it waited for something to run out", from, took, ttl, w.took)
			}
		}
		// Staged, else this checks nothing. (A handover is not staged
		// when a renewal happens to be in flight: at least one of two.)
		if n := postgres.StagedCommits(g.stores["a"]) + postgres.StagedCommits(g.stores["b"]); n < 1 {
			t.Fatalf("%d of the 2 handovers were staged; want at least one", n)
		}
	})

	t.Run("RequestTransfer from another process moves leadership to the named candidate", func(t *testing.T) {
		t.Parallel()
		const ttl = 3 * time.Second // the leader acts at its next renewal, within ttl/3
		g := newTransferGroup(t, strategy, "request", ttl)
		for _, id := range []string{"a", "b", "c"} {
			g.start(t, id, 0)
		}
		from, term := g.leader(t)
		g.enlisted(t, from)
		to := map[string]string{"a": "c", "b": "a", "c": "b"}[from]
		tool := newTransferStore(t, strategy, g.s.pool) // the leader command's transfer subcommand, say
		l, err := leader.RequestTransfer(t.Context(), tool, g.name, to)
		if err != nil {
			t.Fatalf("RequestTransfer to %s: %v", to, err)
		}
		g.checkSuccessor(t, "RequestTransfer", l, to, term, leader.GrantTransfer)
	})

	t.Run("a candidate of a higher priority is handed over to once the leader has led its minimum tenure", func(t *testing.T) {
		t.Parallel()
		const ttl = 2 * time.Second
		g := newTransferGroup(t, strategy, "priority", ttl)
		g.start(t, "low", 0)
		from, term := g.leader(t)
		g.start(t, "high", 5)
		// Mid starts once high is a candidate: had mid's request come
		// while high was not yet enlisted (its store's first attempt
		// still under way), low would rightly hand over to mid.
		g.enlisted(t, from)
		g.start(t, "mid", 1) // above the leader too, but below high
		electortest.Eventually(t, 6*ttl, "high to lead", g.es["high"].IsLeader)
		st := g.es["high"].Status()
		if st.Reason != leader.GrantPriority || st.Term != term+1 {
			t.Fatalf("high leads with %+v; want term %d, reason priority", st, term+1)
		}
		// Equals never move leadership, nor does a lower priority. (High's
		// OnElected records its election just after IsLeader turns true.)
		electortest.Eventually(t, ttl, "high's election in the history", func() bool { return len(g.s.history.Elections()) >= 2 })
		electortest.Never(t, 2*ttl, "another election", func() bool { return len(g.s.history.Elections()) != 2 })
	})

	t.Run("a lease handed to a successor that never comes is refused to the others until the hold has passed", func(t *testing.T) {
		t.Parallel()
		const ttl = 6 * time.Second
		const hold = ttl / 3 // the default RenewInterval
		g := newTransferGroup(t, strategy, "ghost", ttl)
		for _, id := range []string{"a", "b", "c"} {
			g.start(t, id, 0)
		}
		from, term := g.leader(t)
		ghost := leader.Candidate{ID: "ghost", Token: "the ghost's token"}
		if err := g.stores[from].Enlist(t.Context(), g.name, ghost, time.Minute); err != nil {
			t.Fatal(err)
		}
		// The intruder tries once on each store before the handover, so
		// that its tries within the hold find their sessions open (on a
		// loaded machine, opening three took longer than the hold).
		intruder := leader.Candidate{ID: "intruder", Token: "intruder's token"}
		for _, store := range g.stores {
			if _, granted, err := store.Acquire(t.Context(), g.name, intruder, ttl); err != nil || granted {
				t.Fatalf("the intruder's try while %s leads: granted %v, %v; want refused", from, granted, err)
			}
		}
		transferred := make(chan error, 1)
		go func() {
			_, err := g.es[from].Transfer(t.Context(), "ghost")
			transferred <- err
		}()
		var all []*leader.Elector
		for _, e := range g.es {
			all = append(all, e)
		}
		electortest.Eventually(t, 10*time.Second, "the leader to hand over", func() bool {
			l, err := g.stores[from].Observe(t.Context(), g.name)
			return err == nil && l.Successor == "ghost"
		})
		handed := time.Now()
		// Another candidate, as a follower woken by the handover: refused,
		// and told whom the lease is reserved for.
		for _, store := range g.stores {
			l, granted, err := store.Acquire(t.Context(), g.name, intruder, ttl)
			if err != nil || granted || l.Held() || l.Successor != "ghost" || l.Reserved <= 0 || l.Reserved > hold || l.Term != term {
				t.Fatalf("Acquire of a lease handed to ghost = %+v, granted %v, %v; want refused, reserved for ghost for at most %v, term %d", l, granted, err, hold, term)
			}
		}
		electortest.Never(t, max(hold*3/4-time.Since(handed), 0), "a leader while the lease is reserved for ghost", func() bool {
			return len(electortest.Leaders(all)) > 0
		})
		select {
		case err := <-transferred:
			if !errors.Is(err, leader.ErrTransferNotTaken) {
				t.Errorf("Transfer to a successor that never came: %v; want ErrTransferNotTaken", err)
			}
		case <-time.After(3 * ttl):
			t.Fatal("Transfer to a successor that never came did not return")
		}
		_, next := g.leader(t)
		if next != term+1 {
			t.Errorf("after the hold, a leader with term %d; want %d", next, term+1)
		}
		for _, e := range g.es {
			if st := e.Status(); st.IsLeader && st.Reason != leader.GrantRelease {
				t.Errorf("the leader after the hold was granted for %q; want %q", st.Reason, leader.GrantRelease)
			}
		}
	})
}

// BenchmarkHandoverGap measures the leaderless gap of a handover, on each
// strategy: from the holder's ReleaseTo call to the successor's grant (its
// Acquire's return), the successor woken by the release (WatchFree) on a
// store of its own, and a third candidate, on a store of its own too,
// woken beside it and refused. It reports the median and the 99th
// percentile.
//
//	go test -run '^$' -bench HandoverGap -benchtime=500x ./postgres/
func BenchmarkHandoverGap(b *testing.B) {
	for _, strategy := range []postgres.Strategy{postgres.StrategyLease, postgres.StrategyAdvisory} {
		b.Run(string(strategy), func(b *testing.B) { benchmarkHandoverGap(b, strategy) })
	}
}

// grantSeen is a grant that a candidate of benchmarkHandoverGap received.
type grantSeen struct {
	who  int
	term uint64
	at   time.Time
}

func benchmarkHandoverGap(b *testing.B, strategy postgres.Strategy) {
	s := newElection(b)
	const (
		name = "gap"
		ttl  = time.Minute
	)
	var (
		cands   [3]leader.Candidate
		stores  [3]transferStore
		seen    = make(chan grantSeen, 16)
		holding atomic.Int32 // the candidate that holds the lease, or -1
	)
	for i := range cands {
		cands[i] = leader.Candidate{ID: fmt.Sprint("c", i), Token: fmt.Sprint("token-", i)}
		stores[i] = newTransferStore(b, strategy, s.pool)
	}
	first, granted, err := stores[0].Acquire(b.Context(), name, cands[0], ttl)
	if err != nil || !granted {
		b.Fatalf("first grant: %+v, %v, %v", first, granted, err)
	}
	for i := range cands {
		wake, err := stores[i].(leader.FreeWatcher).WatchFree(b.Context(), name)
		if err != nil {
			b.Fatal(err)
		}
		go func() {
			for range wake {
				if holding.Load() == int32(i) {
					continue // a grant to the holder would be a new term
				}
				l, ok, err := stores[i].Acquire(b.Context(), name, cands[i], ttl)
				if err == nil && ok {
					holding.Store(int32(i))
					seen <- grantSeen{who: i, term: l.Term, at: time.Now()}
				}
			}
		}()
	}
	time.Sleep(300 * time.Millisecond) // the listeners and lock waiters settle
	term := first.Term
	var gaps []time.Duration
	b.ResetTimer()
	for i := range b.N {
		b.StopTimer()
		time.Sleep(20 * time.Millisecond) // the refused candidates settle; handovers are rare
		holder, successor := i%3, (i+1)%3
		b.StartTimer()
		start := time.Now()
		if err := stores[holder].ReleaseTo(b.Context(), name, cands[holder].Token, term, cands[successor], leader.GrantTransfer, ttl); err != nil {
			b.Fatal(err)
		}
		holding.CompareAndSwap(int32(holder), -1)
		for {
			g := <-seen
			if g.term <= term {
				continue
			}
			if g.who != successor || g.term != term+1 {
				b.Fatalf("handover %d: c%d granted term %d; want c%d, term %d", i, g.who, g.term, successor, term+1)
			}
			gaps, term = append(gaps, g.at.Sub(start)), g.term
			break
		}
	}
	b.StopTimer()
	slices.Sort(gaps)
	b.ReportMetric(float64(gaps[len(gaps)/2].Microseconds())/1000, "p50-ms/handover")
	b.ReportMetric(float64(gaps[len(gaps)*99/100].Microseconds())/1000, "p99-ms/handover")
}
