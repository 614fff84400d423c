package faults_test

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/leaderelect/leader/internal/history"
	"github.com/leaderelect/leader/internal/monotime"
)

// The stall probe measures how late this process runs a goroutine woken by
// bytes arriving on a loopback socket: the path by which an advisory
// holder learns that the server ended its session (its reader wakes on the
// server's FATAL message). Every probeEvery a writer sends its
// CLOCK_MONOTONIC reading; the reader subtracts it from its own reading
// when it gets the bytes. Delays of stallThreshold or more are kept.
//
// The advisory strategy's safety after a session ends depends on the
// holder noticing within TakeoverGrace (see postgres.AdvisoryStore); a
// process stalled longer than that is in the position of a paused one. The
// probe does not excuse anything: an overlap fails its test whatever the
// probe saw. It says, in the failure and in the soak's summary, whether the
// machine was starving the process at the time.
const (
	probeEvery     = 5 * time.Millisecond
	stallThreshold = 20 * time.Millisecond
)

// stall is one late wake-up of the probe's reader.
type stall struct {
	at    int64 // CLOCK_MONOTONIC when the reader ran
	delay time.Duration
}

// stallProbe is the process's probe; see startStallProbe.
type stallProbe struct {
	mu     sync.Mutex
	stalls []stall // at most maxStalls, the latest
	n      int     // wake-ups measured
	late   int     // of which stallThreshold or later
	over   int     // of which later than grace
	worst  stall
	grace  time.Duration
	stop   func()
}

const maxStalls = 10000

// probe is the running probe, or nil.
var probe *stallProbe

// startStallProbe starts the probe on a loopback TCP connection, counting
// the wake-ups later than grace apart.
func startStallProbe(grace time.Duration) (*stallProbe, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			accepted <- nil
			return
		}
		accepted <- c
	}()
	w, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		return nil, err
	}
	r := <-accepted
	if r == nil {
		w.Close()
		return nil, fmt.Errorf("stall probe: accept failed")
	}
	p := &stallProbe{grace: grace}
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() { // writer
		tick := time.NewTicker(probeEvery)
		defer tick.Stop()
		var buf [8]byte
		for {
			select {
			case <-done:
				return
			case <-tick.C:
			}
			now, err := monotime.Now()
			if err != nil {
				return
			}
			binary.BigEndian.PutUint64(buf[:], uint64(now))
			if _, err := w.Write(buf[:]); err != nil {
				return
			}
		}
	})
	wg.Go(func() { // reader
		var buf [8]byte
		for {
			if _, err := io.ReadFull(r, buf[:]); err != nil {
				return
			}
			now, err := monotime.Now()
			if err != nil {
				return
			}
			p.record(now, time.Duration(now-int64(binary.BigEndian.Uint64(buf[:]))))
		}
	})
	p.stop = func() {
		close(done)
		w.Close()
		r.Close()
		wg.Wait()
	}
	return p, nil
}

func (p *stallProbe) record(at int64, delay time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.n++
	if delay > p.worst.delay {
		p.worst = stall{at, delay}
	}
	if delay < stallThreshold {
		return
	}
	p.late++
	if delay > p.grace {
		p.over++
	}
	if len(p.stalls) == maxStalls {
		p.stalls = slices.Delete(p.stalls, 0, maxStalls/10)
	}
	p.stalls = append(p.stalls, stall{at, delay})
}

// within returns the stalls whose delay overlaps [from, to].
func (p *stallProbe) within(from, to int64) []stall {
	if p == nil {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []stall
	for _, s := range p.stalls {
		if s.at >= from && s.at-int64(s.delay) <= to {
			out = append(out, s)
		}
	}
	return out
}

// explain describes what the probe saw around each of overlaps: from a
// second before the second interval began until the first one ended.
func (p *stallProbe) explain(overlaps []history.Overlap) string {
	if p == nil || len(overlaps) == 0 {
		return ""
	}
	var b strings.Builder
	for _, o := range overlaps {
		from, to := o.Second.Start-int64(time.Second), o.First.End
		ss := p.within(from, to)
		worst := time.Duration(0)
		for _, s := range ss {
			worst = max(worst, s.delay)
		}
		fmt.Fprintf(&b, "stall probe around the %v overlap: %d loopback wake-ups %v or later, the worst %v\n",
			o.Duration, len(ss), stallThreshold, worst)
	}
	return b.String()
}

// summary describes what the probe saw over the whole run.
func (p *stallProbe) summary() string {
	if p == nil {
		return ""
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return fmt.Sprintf("Stall probe: %d loopback wake-ups measured; %d came %v or more late, %d more than the advisory TakeoverGrace (%v) late; the worst %v late.",
		p.n, p.late, stallThreshold, p.over, p.grace, p.worst.delay.Round(time.Millisecond))
}

func TestStallProbeReportsTheLateWakeUpsAroundAnOverlap(t *testing.T) {
	p := &stallProbe{grace: 50 * time.Millisecond}
	ms := int64(time.Millisecond)
	p.record(1000*ms, 5*time.Millisecond)   // on time: counted, not kept
	p.record(2000*ms, 30*time.Millisecond)  // late, within the grace
	p.record(5000*ms, 300*time.Millisecond) // later than the grace: 4700 to 5000 ms
	p.record(9000*ms, 80*time.Millisecond)  // after the overlap
	if p.n != 4 || p.late != 3 || p.over != 2 || p.worst.delay != 300*time.Millisecond {
		t.Fatalf("n %d, late %d, over %d, worst %v; want 4, 3, 2, 300ms", p.n, p.late, p.over, p.worst.delay)
	}
	o := history.Overlap{
		First:    history.Interval{Start: 0, End: 4800 * ms},
		Second:   history.Interval{Start: 4500 * ms, End: 8000 * ms},
		Duration: 300 * time.Millisecond,
	}
	// From a second before the second interval to the first's end: 3.5 s
	// to 4.8 s. Only the stall that began at 4.7 s overlaps it.
	got := p.explain([]history.Overlap{o})
	want := "stall probe around the 300ms overlap: 1 loopback wake-ups 20ms or later, the worst 300ms\n"
	if got != want {
		t.Errorf("explain = %q, want %q", got, want)
	}
	if !strings.Contains(p.summary(), "4 loopback wake-ups measured; 3 came 20ms or more late, 2 more than the advisory TakeoverGrace (50ms) late; the worst 300ms late") {
		t.Errorf("summary = %q", p.summary())
	}
}

func TestStallProbeMeasuresLoopbackWakeUps(t *testing.T) {
	p, err := startStallProbe(50 * time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		p.mu.Lock()
		n := p.n
		p.mu.Unlock()
		if n >= 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d wake-ups measured in 10s, want 3 (one every %v)", n, probeEvery)
		}
		time.Sleep(probeEvery)
	}
	p.stop()
}
