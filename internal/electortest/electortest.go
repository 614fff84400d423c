// Package electortest holds test machinery shared by the project's own
// tests of Electors on every store: a history of who believed it led, checked
// for overlaps and for terms that go backwards (DESIGN.md invariants 1 and 2),
// and helpers to run Electors and wait for conditions.
package electortest

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/leaderelect/leader"
)

// History records who believed it led, in order, across Electors. It fails
// the test the moment one instance is elected while another still leads, or
// is elected with a term not above every term seen before.
type History struct {
	mu      sync.Mutex
	changed *sync.Cond // signalled on every recorded event
	events  []Event
	open    map[string]uint64 // instance -> term while leading
	counts  map[string]int    // instance -> elections minus demotions
}

// Event is one recorded election or demotion.
type Event struct {
	At       time.Time
	Instance string
	Elected  bool // false: demoted
	Term     uint64
}

// NewHistory returns an empty History.
func NewHistory() *History {
	h := &History{open: make(map[string]uint64), counts: make(map[string]int)}
	h.changed = sync.NewCond(&h.mu)
	return h
}

// Hooks returns OnElected and OnDemoted callbacks recording instance's
// leadership. The OnElected callback returns at once.
func (h *History) Hooks(t testing.TB, instance string) (onElected func(context.Context), onDemoted func()) {
	onElected = func(ctx context.Context) {
		term, ok := leader.TermFrom(ctx)
		if !ok {
			t.Errorf("%s: OnElected context carries no term", instance)
		}
		h.mu.Lock()
		defer h.mu.Unlock()
		for other, ot := range h.open {
			t.Errorf("%s elected (term %d) while %s still leads (term %d)", instance, term, other, ot)
		}
		for i := len(h.events) - 1; i >= 0; i-- {
			if e := h.events[i]; e.Elected && e.Term >= term {
				t.Errorf("%s elected with term %d after %s had term %d", instance, term, e.Instance, e.Term)
				break
			}
		}
		h.open[instance] = term
		h.counts[instance]++
		h.events = append(h.events, Event{At: time.Now(), Instance: instance, Elected: true, Term: term})
		h.changed.Broadcast()
	}
	onDemoted = func() {
		h.mu.Lock()
		defer h.mu.Unlock()
		// OnElected runs on its own goroutine and may not have recorded
		// this leadership yet: wait for it, so each demotion pairs with
		// its election.
		for h.counts[instance] == 0 {
			h.changed.Wait()
		}
		h.counts[instance]--
		term, ok := h.open[instance]
		if !ok {
			t.Errorf("%s: OnDemoted called while not leading", instance)
		}
		delete(h.open, instance)
		h.events = append(h.events, Event{At: time.Now(), Instance: instance, Term: term})
		h.changed.Broadcast()
	}
	return onElected, onDemoted
}

// Elections returns the elections recorded so far.
func (h *History) Elections() []Event {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []Event
	for _, e := range h.events {
		if e.Elected {
			out = append(out, e)
		}
	}
	return out
}

// Find returns the first recorded event matching f.
func (h *History) Find(f func(Event) bool) (Event, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, e := range h.events {
		if f(e) {
			return e, true
		}
	}
	return Event{}, false
}

// Run runs e until the test ends or the returned stop is called, and fails
// the test if Run returns an error. stop returns when Run has returned.
func Run(t testing.TB, e *leader.Elector) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := e.Run(ctx); err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			<-done
		})
	}
	t.Cleanup(stop)
	return stop
}

// Eventually polls cond until it holds, and fails the test if it does not
// within the given time.
func Eventually(t testing.TB, within time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", within, what)
		}
		time.Sleep(5 * time.Millisecond) // poll interval
	}
}

// Leaders returns the Electors that believe they lead.
func Leaders(es []*leader.Elector) []*leader.Elector {
	var out []*leader.Elector
	for _, e := range es {
		if e.IsLeader() {
			out = append(out, e)
		}
	}
	return out
}

// Never checks cond for the given time and fails the test if it ever holds.
func Never(t testing.TB, during time.Duration, what string, cond func() bool) {
	t.Helper()
	end := time.Now().Add(during)
	for time.Now().Before(end) {
		if cond() {
			t.Fatalf("%s", what)
		}
		time.Sleep(10 * time.Millisecond) // poll interval
	}
}

// LogBuffer collects log output written from several goroutines, for tests
// that check what an Elector logged.
type LogBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

// Write implements io.Writer.
func (l *LogBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// String returns everything written so far.
func (l *LogBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
