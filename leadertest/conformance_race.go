package leadertest

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/leaderelect/leader"
)

func testAcquireRace(t *testing.T, s leader.Store) {
	name := newName()
	const racers = 20
	candidates := make([]leader.Candidate, racers)
	for i := range candidates {
		candidates[i] = newCandidate(fmt.Sprintf("racer-%d", i))
	}
	race := func(round int) (leader.Candidate, leader.Lease) {
		t.Helper()
		type result struct {
			lease   leader.Lease
			granted bool
			err     error
		}
		results := make([]result, racers)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i, c := range candidates {
			wg.Go(func() {
				<-start
				ctx, cancel := context.WithTimeout(t.Context(), waitTimeout)
				defer cancel()
				l, granted, err := s.Acquire(ctx, name, c, longTTL)
				results[i] = result{l, granted, err}
			})
		}
		close(start)
		wg.Wait()
		winner := -1
		for i, r := range results {
			switch {
			case r.err != nil:
				t.Fatalf("round %d: racer %d: Acquire: %v", round, i, r.err)
			case r.granted && winner >= 0:
				t.Fatalf("round %d: racers %d and %d were both granted the lease (terms %d and %d)",
					round, winner, i, results[winner].lease.Term, r.lease.Term)
			case r.granted:
				winner = i
			}
		}
		if winner < 0 {
			t.Fatalf("round %d: none of %d racers was granted a free lease", round, racers)
		}
		w := results[winner].lease
		for i, r := range results {
			// A refused racer ran after the grant, so it saw the winner.
			if !r.granted && (r.lease.HolderID != candidates[winner].ID || r.lease.Term != w.Term || !r.lease.Held()) {
				t.Errorf("round %d: racer %d was refused but told %s; the winner holds term %d", round, i, fmtLease(r.lease), w.Term)
			}
		}
		checkHeld(t, "Observe after the race", observe(t, s, name), name, candidates[winner].ID, w.Term, longTTL)
		return candidates[winner], w
	}
	c, l := race(1)
	mustRelease(t, s, name, c, l.Term)
	_, l2 := race(2)
	if l2.Term != l.Term+1 {
		t.Fatalf("second race granted term %d after %d; want %d", l2.Term, l.Term, l.Term+1)
	}
}

// historyEvent is one successful call in testRaceHistory.
type historyEvent struct {
	op         string // "grant", "renew" or "release"
	term       uint64
	token      string
	sent, recv time.Time
}

func testRaceHistory(t *testing.T, s leader.Store) {
	name := newName()
	const (
		workers  = 4
		duration = time.Second
		ttl      = 150 * time.Millisecond
	)
	var (
		mu      sync.Mutex
		history []historyEvent
		grants  int
	)
	record := func(op string, term uint64, token string, sent, recv time.Time) {
		mu.Lock()
		history = append(history, historyEvent{op, term, token, sent, recv})
		if op == "grant" {
			grants++
		}
		mu.Unlock()
	}
	// The workers run for duration, and on until the history has two
	// grants (a busy machine may not get that far), for at most
	// waitTimeout; checkHistory fails a history with fewer.
	deadline, giveUp := time.Now().Add(duration), time.Now().Add(waitTimeout)
	more := func() bool {
		now := time.Now()
		if now.Before(deadline) {
			return true
		}
		mu.Lock()
		defer mu.Unlock()
		return grants < 2 && now.Before(giveUp)
	}
	pause := func() { time.Sleep(time.Duration(rand.Int64N(int64(3 * time.Millisecond)))) } // follower pacing
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			ctx := t.Context()
			c := newCandidate(fmt.Sprintf("worker-%d", w))
			for more() && ctx.Err() == nil {
				sent := time.Now()
				l, granted, err := s.Acquire(ctx, name, c, ttl)
				recv := time.Now()
				if err != nil {
					t.Errorf("worker %d: Acquire: %v", w, err)
					return
				}
				if !granted {
					pause()
					continue
				}
				record("grant", l.Term, c.Token, sent, recv)
				term := l.Term
				for range rand.IntN(3) {
					sent := time.Now()
					r, err := s.Renew(ctx, name, c.Token, term, ttl)
					recv := time.Now()
					if errors.Is(err, leader.ErrLeaseLost) {
						break
					}
					if err != nil {
						t.Errorf("worker %d: Renew: %v", w, err)
						return
					}
					if r.Term != term {
						t.Errorf("worker %d: renewal of term %d reports term %d", w, term, r.Term)
					}
					record("renew", term, c.Token, sent, recv)
				}
				switch rand.IntN(6) {
				case 0: // crash: abandon the lease and come back as a new instance
					c = newCandidate(c.ID)
				case 1: // acquire again at once while holding: a re-grant
					continue
				default:
					sent := time.Now()
					err := s.Release(ctx, name, c.Token, term)
					recv := time.Now()
					switch {
					case err == nil:
						record("release", term, c.Token, sent, recv)
					case !errors.Is(err, leader.ErrLeaseLost):
						t.Errorf("worker %d: Release: %v", w, err)
						return
					}
				}
				pause()
			}
		})
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	counts := make(map[string]int)
	for _, e := range history {
		counts[e.op]++
	}
	t.Logf("history: %d grants, %d renewals, %d releases", counts["grant"], counts["renew"], counts["release"])
	checkHistory(t, history, ttl)
}

// checkHistory checks the successful calls of testRaceHistory.
func checkHistory(t *testing.T, history []historyEvent, ttl time.Duration) {
	t.Helper()
	var grants []historyEvent
	byTerm := make(map[uint64]*historyEvent) // the grant of each term
	for i, e := range history {
		if e.op != "grant" {
			continue
		}
		if g, ok := byTerm[e.term]; ok {
			t.Fatalf("term %d was granted twice: to %s and to %s", e.term, g.token, e.token)
		}
		byTerm[e.term] = &history[i]
		grants = append(grants, e)
	}
	if len(grants) < 2 {
		t.Fatalf("only %d grants in %d calls; the history proves nothing", len(grants), len(history))
	}
	for _, e := range history {
		if g, ok := byTerm[e.term]; !ok || g.token != e.token {
			t.Fatalf("%s of term %d by token %s, but that term was not granted to that token", e.op, e.term, e.token)
		}
	}

	slices.SortFunc(grants, func(a, b historyEvent) int { return cmp.Compare(a.term, b.term) })
	for i := 1; i < len(grants); i++ {
		if grants[i].term != grants[i-1].term+1 {
			t.Fatalf("grants skipped from term %d to term %d; every grant adds one", grants[i-1].term, grants[i].term)
		}
	}
	// Real-time order: a grant that returned before another was sent has
	// the lower term. Walking terms downwards, keep the earliest return of
	// any higher term.
	earliest := time.Time{}
	var earliestTerm uint64
	for i := len(grants) - 1; i >= 0; i-- {
		g := grants[i]
		if !earliest.IsZero() && earliest.Before(g.sent) {
			t.Fatalf("grant of term %d returned before the grant of term %d was sent; terms went back", earliestTerm, g.term)
		}
		if earliest.IsZero() || g.recv.Before(earliest) {
			earliest, earliestTerm = g.recv, g.term
		}
	}
	// Leader safety: another token's grant never returns before the previous
	// holder's lease could have run out, unless that holder released it.
	lastSent := make(map[uint64]time.Time) // latest successful grant or renewal sent
	released := make(map[uint64]time.Time) // release sent
	for _, e := range history {
		switch e.op {
		case "grant", "renew":
			if e.sent.After(lastSent[e.term]) {
				lastSent[e.term] = e.sent
			}
		case "release":
			released[e.term] = e.sent
		}
	}
	for i := 1; i < len(grants); i++ {
		prev, next := grants[i-1], grants[i]
		if prev.token == next.token {
			continue
		}
		if rel, ok := released[prev.term]; ok {
			if next.recv.Before(rel) {
				t.Fatalf("term %d was granted before term %d's holder sent its release", next.term, prev.term)
			}
			continue
		}
		if mustEnd := lastSent[prev.term].Add(ttl - clockSlack); next.recv.Before(mustEnd) {
			t.Fatalf("term %d was granted to another token %v before term %d could have expired",
				next.term, mustEnd.Sub(next.recv), prev.term)
		}
	}
}
