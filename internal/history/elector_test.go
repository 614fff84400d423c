package history_test

import (
	"context"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/internal/history"
	"github.com/leaderelect/leader/leadertest"
)

// ttl is the participants' TTL: long enough that renewals keep up on a
// busy machine. A takeover after a Resign takes at most RetryInterval (a
// third of it), when every other participant has just resigned too.
const ttl = 5 * time.Second

// participant is one Elector under test and what records it.
type participant struct {
	id   string
	e    *leader.Elector
	rec  *history.Recorder
	stop func()
}

// newParticipant returns an Elector for id on store, recording into dir
// through a RecordingStore and the hooks. It runs until stop.
func newParticipant(t *testing.T, dir string, store leader.Store, id string) *participant {
	t.Helper()
	rec, err := history.Create(dir, name)
	if err != nil {
		t.Fatal(err)
	}
	onElected, onDemoted := rec.Hooks(id)
	e, err := leader.New(rec.Store(store, id), leader.Config{
		Name:      name,
		ID:        id,
		TTL:       ttl,
		Logger:    slog.New(slog.DiscardHandler),
		OnElected: onElected,
		OnDemoted: onDemoted,
	})
	if err != nil {
		t.Fatal(err)
	}
	return &participant{id: id, e: e, rec: rec, stop: electortest.Run(t, e)}
}

// stopAll stops every participant and checks that each recorded all.
func stopAll(t *testing.T, ps []*participant) {
	t.Helper()
	for _, p := range ps {
		p.stop()
		if err := p.rec.Close(); err != nil {
			t.Fatalf("%s: %v", p.id, err)
		}
	}
}

func leaders(ps []*participant) []*participant {
	var out []*participant
	for _, p := range ps {
		if p.e.IsLeader() {
			out = append(out, p)
		}
	}
	return out
}

func TestElectorsOnMemStore(t *testing.T) {
	t.Parallel()

	t.Run("handovers by Resign leave a history without overlaps and with growing terms", func(t *testing.T) {
		t.Parallel()
		dir := t.TempDir()
		store := leadertest.NewMemStore()
		var ps []*participant
		for i := range 3 {
			ps = append(ps, newParticipant(t, dir, store, fmt.Sprint("e", i)))
		}
		const handovers = 5
		var lastTerm uint64
		for range handovers {
			var cur *participant
			electortest.Eventually(t, 10*time.Second, "a leader with a new term", func() bool {
				ls := leaders(ps)
				if len(ls) == 1 && ls[0].e.Status().Term > lastTerm {
					cur = ls[0]
					return true
				}
				return false
			})
			lastTerm = cur.e.Status().Term
			ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
			err := cur.e.Resign(ctx)
			cancel()
			if err != nil {
				t.Fatalf("%s: Resign: %v", cur.id, err)
			}
		}
		electortest.Eventually(t, 10*time.Second, "a last leader", func() bool { return len(leaders(ps)) == 1 })
		stopAll(t, ps)

		evs, err := history.Load(dir)
		if err != nil {
			t.Fatal(err)
		}
		for _, startAtSend := range []bool{false, true} {
			rep := history.Check(evs, history.Bounds{MaxTakeover: ttl, StartAtSend: startAtSend})
			if !rep.OK() {
				t.Fatalf("StartAtSend %v: the history fails:\n%v", startAtSend, rep)
			}
			if len(rep.Takeovers) < handovers {
				t.Fatalf("want at least %d takeovers:\n%v", handovers, rep)
			}
			for _, iv := range rep.Intervals {
				// A grant that arrives as Run ends is released unused.
				// OnElected may run after the end (a short leadership).
				if !iv.Granted || iv.Open || (iv.Elected && iv.Start > iv.ElectedAt) {
					t.Errorf("interval %v: want granted, ended, and elected after Start if at all", iv)
				}
			}
			t.Logf("StartAtSend %v: %v", startAtSend, rep)
		}
	})

	t.Run("two Electors on two stores for one name are caught overlapping", func(t *testing.T) {
		t.Parallel()
		dir := t.TempDir()
		ps := []*participant{
			newParticipant(t, dir, leadertest.NewMemStore(), "left"),
			newParticipant(t, dir, leadertest.NewMemStore(), "right"),
		}
		electortest.Eventually(t, 10*time.Second, "both to lead", func() bool { return len(leaders(ps)) == 2 })
		stopAll(t, ps)

		evs, err := history.Load(dir)
		if err != nil {
			t.Fatal(err)
		}
		rep := history.Check(evs, history.Bounds{})
		if rep.OK() || len(rep.Overlaps) == 0 {
			t.Fatalf("the split brain passed:\n%v", rep)
		}
		o := rep.Overlaps[0]
		if o.First.Instance == o.Second.Instance || o.Duration <= 0 {
			t.Errorf("overlap %v: want the two instances, for a positive time", o)
		}
		// Each store began at term 1.
		if len(rep.TermRegressions) == 0 {
			t.Errorf("two grants of term 1 passed:\n%v", rep)
		}
		t.Logf("caught: %v", rep)
	})
}
