package main

import (
	"math"
	"slices"
	"sync"
	"time"
)

// roundRecorder groups a process's renewals into rounds. The Electors renew
// on a grid of period renew shared by the process (leader's renewEpoch,
// which the bench cannot read): the first Renew call anchors the grid as
// the recorder sees it, and each Renew call and renewal statement belongs
// to the round whose grid point is nearest its start. (A renewal retried
// after a failure, RenewInterval/4 off the grid, joins the nearest round.)
type roundRecorder struct {
	renew time.Duration

	mu     sync.Mutex
	anchor time.Time
	rounds map[int]*roundAgg
	errors int64 // failed Renew calls, in all
}

// seen returns how many rounds have had a Renew call so far.
func (r *roundRecorder) seen() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return int64(len(r.rounds))
}

// roundAgg is one round: its Renew calls (start: when the Elector's timer
// fired; end: when Renew returned) and its renewal statements (the
// tracer's start and end).
type roundAgg struct {
	firstStart, lastStart, lastEnd time.Time
	calls, errors                  int
	stmts                          []stmtSpan
}

type stmtSpan struct {
	start, end time.Time
	failed     bool
}

func newRoundRecorder(renew time.Duration) *roundRecorder {
	return &roundRecorder{renew: renew, rounds: map[int]*roundAgg{}}
}

// round returns t's round; r.mu is held.
func (r *roundRecorder) round(t time.Time) *roundAgg {
	if r.anchor.IsZero() {
		r.anchor = t
	}
	k := int(math.Round(float64(t.Sub(r.anchor)) / float64(r.renew)))
	a := r.rounds[k]
	if a == nil {
		a = &roundAgg{firstStart: t, lastStart: t, lastEnd: t}
		r.rounds[k] = a
	}
	return a
}

func (r *roundRecorder) call(start, end time.Time, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	a := r.round(start)
	a.calls++
	if start.Before(a.firstStart) {
		a.firstStart = start
	}
	if start.After(a.lastStart) {
		a.lastStart = start
	}
	if end.After(a.lastEnd) {
		a.lastEnd = end
	}
	if err != nil {
		a.errors++
		r.errors++
	}
}

func (r *roundRecorder) statement(start, end time.Time, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	a := r.round(start)
	a.stmts = append(a.stmts, stmtSpan{start, end, err != nil})
}

func (r *roundRecorder) failedCalls() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.errors
}

// roundReport is one round of a scale-names process.
type roundReport struct {
	AtS        float64   `json:"at_s"`        // its grid point, after the window began
	Calls      int       `json:"calls"`       // Renew calls (Electors renewed, or tried to)
	Errors     int       `json:"errors"`      // of which failed
	Statements int       `json:"statements"`  // renewal statements sent
	SpreadMs   float64   `json:"spread_ms"`   // first to last Renew call's start: how long the calls took to arrive
	WaitMs     float64   `json:"wait_ms"`     // first call's start to the first statement's start
	LatencyMs  float64   `json:"latency_ms"`  // first call's start to the last call's return: the round
	HandOutMs  float64   `json:"hand_out_ms"` // last statement's end to the last call's return
	StmtMs     []float64 `json:"stmt_ms"`     // each statement, tracer start to end
	StmtFailed int       `json:"stmt_failed"` // statements that returned an error
}

// report returns the rounds whose grid point is in [from, to-renew/2]
// (so that each is whole), in order.
func (r *roundRecorder) report(from, to time.Time) []roundReport {
	r.mu.Lock()
	defer r.mu.Unlock()
	var ks []int
	for k := range r.rounds {
		at := r.anchor.Add(time.Duration(k) * r.renew)
		if !at.Before(from) && !at.After(to.Add(-r.renew/2)) {
			ks = append(ks, k)
		}
	}
	slices.Sort(ks)
	out := make([]roundReport, 0, len(ks))
	for _, k := range ks {
		a := r.rounds[k]
		rr := roundReport{
			AtS:        r.anchor.Add(time.Duration(k) * r.renew).Sub(from).Seconds(),
			Calls:      a.calls,
			Errors:     a.errors,
			Statements: len(a.stmts),
			SpreadMs:   msDur(a.lastStart.Sub(a.firstStart)),
			LatencyMs:  msDur(a.lastEnd.Sub(a.firstStart)),
		}
		var firstStmt, lastStmtEnd time.Time
		for _, s := range a.stmts {
			if firstStmt.IsZero() || s.start.Before(firstStmt) {
				firstStmt = s.start
			}
			if s.end.After(lastStmtEnd) {
				lastStmtEnd = s.end
			}
			rr.StmtMs = append(rr.StmtMs, msDur(s.end.Sub(s.start)))
			if s.failed {
				rr.StmtFailed++
			}
		}
		if !firstStmt.IsZero() {
			rr.WaitMs = msDur(firstStmt.Sub(a.firstStart))
			rr.HandOutMs = msDur(a.lastEnd.Sub(lastStmtEnd))
		}
		out = append(out, rr)
	}
	return out
}

func msDur(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
