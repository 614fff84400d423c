package history_test

import (
	"math"
	"strings"
	"testing"
	"time"

	"github.com/leaderelect/leader/internal/history"
)

const name = "job"

// The synthetic histories below use small integers as CLOCK_MONOTONIC
// readings.

func granted(instance string, term uint64, sent, at int64) history.Event {
	return history.Event{Kind: history.Granted, Name: name, Instance: instance, Term: term, Sent: sent, At: at}
}

func renewed(instance string, term uint64, sent, at int64) history.Event {
	return history.Event{Kind: history.Renewed, Name: name, Instance: instance, Term: term, Sent: sent, At: at}
}

func event(kind history.Kind, instance string, term uint64, at int64) history.Event {
	return history.Event{Kind: kind, Name: name, Instance: instance, Term: term, At: at}
}

// leadership is a complete recorded leadership of instance whose
// conservative interval is [start, end]: granted (sent just before start),
// elected just after start, ended at end, then demoted and released.
func leadership(instance string, term uint64, start, end int64) []history.Event {
	return []history.Event{
		granted(instance, term, start-1, start),
		event(history.Elected, instance, term, start+1),
		event(history.Ended, instance, term, end),
		event(history.Demoted, instance, term, end+1),
		event(history.Released, instance, term, end+2),
	}
}

func events(parts ...[]history.Event) []history.Event {
	var out []history.Event
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

func TestCheck(t *testing.T) {
	t.Parallel()

	t.Run("leaderships that follow each other pass", func(t *testing.T) {
		t.Parallel()
		rep := history.Check(events(
			leadership("a", 1, 10, 20),
			leadership("b", 2, 30, 40),
			leadership("a", 3, 50, 60),
		), history.Bounds{MaxTakeover: 100})
		if !rep.OK() {
			t.Fatalf("failed:\n%v", rep)
		}
		if len(rep.Intervals) != 3 || len(rep.Takeovers) != 2 {
			t.Fatalf("got %d intervals and %d takeovers, want 3 and 2:\n%v", len(rep.Intervals), len(rep.Takeovers), rep)
		}
		// From the end of one to the other's OnElected.
		if got := rep.Takeovers[0].Gap; got != 11 {
			t.Errorf("first takeover gap = %v, want 11ns", got)
		}
	})

	t.Run("two leaderships that overlap are reported with the overlap", func(t *testing.T) {
		t.Parallel()
		rep := history.Check(events(
			leadership("a", 1, 10, 20),
			leadership("b", 2, 15, 30),
		), history.Bounds{})
		if rep.OK() || len(rep.Overlaps) != 1 {
			t.Fatalf("want one overlap:\n%v", rep)
		}
		o := rep.Overlaps[0]
		if o.First.Instance != "a" || o.Second.Instance != "b" || o.Duration != 5 {
			t.Errorf("overlap = %v, want a then b for 5ns", o)
		}
		if len(rep.Takeovers) != 0 {
			t.Errorf("an overlap counted as a takeover: %v", rep.Takeovers)
		}
	})

	t.Run("a leadership inside another is reported", func(t *testing.T) {
		t.Parallel()
		rep := history.Check(events(
			leadership("a", 1, 10, 100),
			leadership("b", 2, 20, 30),
			leadership("c", 3, 200, 300),
		), history.Bounds{})
		if len(rep.Overlaps) != 1 || rep.Overlaps[0].Duration != 10 {
			t.Fatalf("want one overlap of 10ns:\n%v", rep)
		}
	})

	t.Run("leaderships that only touch pass", func(t *testing.T) {
		t.Parallel()
		rep := history.Check(events(
			leadership("a", 1, 10, 20),
			leadership("b", 2, 20, 30),
		), history.Bounds{})
		if !rep.OK() {
			t.Fatalf("failed:\n%v", rep)
		}
	})

	t.Run("leaderships of different names may overlap", func(t *testing.T) {
		t.Parallel()
		other := leadership("b", 1, 15, 30)
		for i := range other {
			other[i].Name = "other"
		}
		rep := history.Check(events(leadership("a", 1, 10, 20), other), history.Bounds{})
		if !rep.OK() {
			t.Fatalf("failed:\n%v", rep)
		}
	})

	t.Run("a term below the previous holder's is reported", func(t *testing.T) {
		t.Parallel()
		rep := history.Check(events(
			leadership("a", 5, 10, 20),
			leadership("b", 4, 30, 40),
		), history.Bounds{})
		if rep.OK() || len(rep.TermRegressions) != 1 {
			t.Fatalf("want one term regression:\n%v", rep)
		}
		if r := rep.TermRegressions[0]; r.Previous.Term != 5 || r.Next.Term != 4 {
			t.Errorf("regression = %v, want 4 after 5", r)
		}
	})

	t.Run("a term equal to the previous holder's is reported", func(t *testing.T) {
		t.Parallel()
		rep := history.Check(events(
			leadership("a", 5, 10, 20),
			leadership("b", 5, 30, 40),
		), history.Bounds{})
		if len(rep.TermRegressions) != 1 {
			t.Fatalf("want one term regression:\n%v", rep)
		}
	})

	t.Run("a term below an earlier holder's but above the last one's is reported", func(t *testing.T) {
		t.Parallel()
		rep := history.Check(events(
			leadership("a", 7, 10, 20),
			leadership("b", 3, 30, 40),
			leadership("c", 5, 50, 60),
		), history.Bounds{})
		if len(rep.TermRegressions) != 2 {
			t.Fatalf("want two term regressions (3 and 5 after 7):\n%v", rep)
		}
	})

	t.Run("a slow takeover is reported", func(t *testing.T) {
		t.Parallel()
		evs := events(
			leadership("a", 1, 10, 20),
			leadership("b", 2, 1000, 1010),
		)
		rep := history.Check(evs, history.Bounds{MaxTakeover: 100})
		if rep.OK() || len(rep.SlowTakeovers) != 1 {
			t.Fatalf("want one slow takeover:\n%v", rep)
		}
		if got := rep.SlowTakeovers[0].Gap; got != 981 {
			t.Errorf("gap = %v, want 981ns", got)
		}
		if rep := history.Check(evs, history.Bounds{MaxTakeover: 981}); !rep.OK() {
			t.Errorf("a takeover within the bound failed:\n%v", rep)
		}
	})

	t.Run("a grant never acted on counts for overlaps but not as a leader", func(t *testing.T) {
		t.Parallel()
		rep := history.Check(events(
			leadership("a", 1, 10, 20),
			[]history.Event{granted("c", 2, 24, 25), event(history.Released, "c", 2, 26)},
			leadership("b", 3, 30, 40),
		), history.Bounds{})
		if !rep.OK() {
			t.Fatalf("failed:\n%v", rep)
		}
		if len(rep.Takeovers) != 1 || rep.Takeovers[0].From.Instance != "a" || rep.Takeovers[0].To.Instance != "b" {
			t.Fatalf("want one takeover from a to b: %v", rep.Takeovers)
		}
		rep = history.Check(events(
			leadership("a", 1, 10, 20),
			[]history.Event{granted("c", 2, 14, 15), event(history.Released, "c", 2, 26)},
		), history.Bounds{})
		if len(rep.Overlaps) != 1 {
			t.Fatalf("want the unused grant's overlap reported:\n%v", rep)
		}
	})

	t.Run("the end is the earliest of the recorded upper bounds", func(t *testing.T) {
		t.Parallel()
		for _, order := range [][3]int64{{30, 25, 40}, {25, 30, 40}, {40, 30, 25}} {
			rep := history.Check([]history.Event{
				granted("a", 1, 9, 10),
				event(history.Elected, "a", 1, 11),
				event(history.Ended, "a", 1, order[0]),
				event(history.Demoted, "a", 1, order[1]),
				event(history.Released, "a", 1, order[2]),
			}, history.Bounds{})
			if !rep.OK() || len(rep.Intervals) != 1 || rep.Intervals[0].End != 25 {
				t.Errorf("ended %v: want one interval ending at 25:\n%v", order, rep)
			}
		}
	})

	t.Run("the start is when the grant returned, or when it was sent", func(t *testing.T) {
		t.Parallel()
		evs := events(
			leadership("a", 1, 1, 7),
			[]history.Event{
				granted("b", 2, 5, 8),
				event(history.Elected, "b", 2, 9),
				event(history.Ended, "b", 2, 20),
			},
		)
		rep := history.Check(evs, history.Bounds{})
		if !rep.OK() || rep.Intervals[1].Start != 8 {
			t.Fatalf("want b to start at 8 and pass:\n%v", rep)
		}
		rep = history.Check(evs, history.Bounds{StartAtSend: true})
		if len(rep.Overlaps) != 1 || rep.Intervals[1].Start != 5 {
			t.Fatalf("with StartAtSend, want b to start at 5 and overlap a:\n%v", rep)
		}
	})

	t.Run("an interval without a recorded grant starts at OnElected and is marked", func(t *testing.T) {
		t.Parallel()
		rep := history.Check([]history.Event{
			event(history.Elected, "a", 1, 10),
			event(history.Ended, "a", 1, 20),
		}, history.Bounds{})
		if !rep.OK() || len(rep.Intervals) != 1 {
			t.Fatalf("failed:\n%v", rep)
		}
		iv := rep.Intervals[0]
		if iv.Granted || iv.Start != 10 || !strings.Contains(iv.String(), "not a lower bound") {
			t.Errorf("interval = %v, want it to start at 10, marked", iv)
		}
	})

	t.Run("an open interval given no end is reported and never ends", func(t *testing.T) {
		t.Parallel()
		rep := history.Check(events(
			[]history.Event{granted("a", 1, 9, 10), event(history.Elected, "a", 1, 11)},
			leadership("b", 2, 50, 60),
		), history.Bounds{})
		if rep.OK() || len(rep.Unended) != 1 || rep.Unended[0].Instance != "a" {
			t.Fatalf("want a reported as unended:\n%v", rep)
		}
		if len(rep.Overlaps) != 1 || rep.Intervals[0].End != math.MaxInt64 {
			t.Fatalf("want the open interval to last for ever and overlap b:\n%v", rep)
		}
	})

	t.Run("an open interval ends where the caller says", func(t *testing.T) {
		t.Parallel()
		evs := events(
			[]history.Event{granted("a", 1, 9, 10), event(history.Elected, "a", 1, 11)},
			leadership("b", 2, 50, 60),
		)
		rep := history.Check(evs, history.Bounds{OpenEnd: history.EndOpenAt(40)})
		if !rep.OK() {
			t.Fatalf("killed at 40: failed:\n%v", rep)
		}
		if iv := rep.Intervals[0]; !iv.Open || iv.End != 40 {
			t.Errorf("interval = %v, want open, ending at 40", iv)
		}
		if got := rep.Takeovers[0].Gap; got != 11 {
			t.Errorf("takeover from the kill = %v, want 11ns", got)
		}
		rep = history.Check(evs, history.Bounds{OpenEnd: history.EndOpenAt(55)})
		if len(rep.Overlaps) != 1 || len(rep.Unended) != 0 {
			t.Fatalf("killed at 55: want one overlap:\n%v", rep)
		}
	})

	t.Run("an open interval can end at the deadline of its last renewal", func(t *testing.T) {
		t.Parallel()
		open := []history.Event{
			granted("a", 1, 9, 10),
			event(history.Elected, "a", 1, 11),
			renewed("a", 1, 20, 21),
			renewed("a", 1, 30, 31),
		}
		rep := history.Check(events(open, leadership("b", 2, 60, 70)), history.Bounds{OpenEnd: history.EndOpenAtDeadline(20)})
		if !rep.OK() || rep.Intervals[0].End != 50 {
			t.Fatalf("want a to end at 30+20 and pass:\n%v", rep)
		}
		rep = history.Check(events(open, leadership("b", 2, 45, 70)), history.Bounds{OpenEnd: history.EndOpenAtDeadline(20)})
		if len(rep.Overlaps) != 1 {
			t.Fatalf("want b, elected before a's deadline, to overlap:\n%v", rep)
		}
		rep = history.Check([]history.Event{event(history.Elected, "a", 1, 11)}, history.Bounds{OpenEnd: history.EndOpenAtDeadline(20)})
		if len(rep.Unended) != 1 {
			t.Fatalf("want an interval with no grant or renewal left unended:\n%v", rep)
		}
	})

	t.Run("events that make no sense together are invalid", func(t *testing.T) {
		t.Parallel()
		for what, evs := range map[string][]history.Event{
			"granted twice":               {granted("a", 1, 1, 2), granted("a", 1, 3, 4), event(history.Ended, "a", 1, 9)},
			"an end without a start":      {event(history.Released, "a", 1, 9)},
			"ending before it is granted": {granted("a", 1, 5, 6), event(history.Released, "a", 1, 3)},
			"an unknown kind":             {{Kind: "crowned", Name: name, Instance: "a", Term: 1, At: 1}},
		} {
			if rep := history.Check(evs, history.Bounds{}); rep.OK() || len(rep.Invalid) == 0 {
				t.Errorf("%s: want it reported as invalid:\n%v", what, rep)
			}
		}
	})
}

func TestSummarize(t *testing.T) {
	t.Parallel()
	var ds []time.Duration
	for i := 100; i >= 1; i-- {
		ds = append(ds, time.Duration(i)*time.Millisecond)
	}
	got := history.Summarize(ds)
	want := history.Summary{N: 100, P50: 50 * time.Millisecond, P99: 99 * time.Millisecond, Max: 100 * time.Millisecond}
	if got != want {
		t.Errorf("Summarize(1..100ms) = %v, want %v", got, want)
	}
	if got := history.Summarize([]time.Duration{7}); got != (history.Summary{N: 1, P50: 7, P99: 7, Max: 7}) {
		t.Errorf("Summarize(7ns) = %v", got)
	}
	if got := history.Summarize(nil); got.N != 0 || got.String() != "none" {
		t.Errorf("Summarize(nil) = %v", got)
	}
}
