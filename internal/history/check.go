package history

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"
)

// Interval is one leadership as recorded: one grant of a term to one
// instance, and the believed leadership that followed it, if any.
// [Start, End] contains the true interval of belief (see the package
// documentation), except where Granted is false.
type Interval struct {
	Name     string
	Instance string
	Term     uint64

	// Start is a lower bound of when the instance started believing it
	// leads: when the granting Acquire returned, or was sent (see
	// Bounds.StartAtSend). Without a recorded grant it is ElectedAt, which
	// is not a lower bound.
	Start int64
	// End is an upper bound of when the belief ended: the earliest of the
	// leader context seen cancelled, OnDemoted called, and the Release sent.
	// For an Open interval it is what Bounds.OpenEnd gave, or math.MaxInt64.
	End int64

	// Granted reports that the grant was recorded (by a RecordingStore), so
	// that Start is a lower bound.
	Granted bool
	// Elected reports that OnElected was called, at ElectedAt (an upper
	// bound of the start). A grant never followed by OnElected was not
	// acted on: the Elector released it (it came too late, or Run was
	// ending), or the process died first.
	Elected   bool
	ElectedAt int64
	// Open reports that no end was recorded: the process was killed, or
	// the history was read while it still led.
	Open bool
	// LastSent is when the latest successful Acquire or Renew under this
	// term was sent (0 if none was recorded). The Elector's local deadline
	// is LastSent + TTL - DriftMargin at the latest.
	LastSent int64
}

func (iv Interval) String() string {
	end := fmt.Sprint(iv.End)
	if iv.End == math.MaxInt64 {
		end = "never"
	}
	s := fmt.Sprintf("%s/%s term %d [%d, %s]", iv.Name, iv.Instance, iv.Term, iv.Start, end)
	if iv.End != math.MaxInt64 {
		s += fmt.Sprintf(" (%v)", ns(iv.End-iv.Start))
	}
	var notes []string
	if !iv.Granted {
		notes = append(notes, "no grant recorded: start not a lower bound")
	}
	if !iv.Elected {
		notes = append(notes, "never elected")
	}
	if iv.Open {
		notes = append(notes, "open")
	}
	if len(notes) > 0 {
		s += " (" + strings.Join(notes, "; ") + ")"
	}
	return s
}

// led reports whether the instance may have acted as leader in iv.
func (iv Interval) led() bool { return iv.Elected || iv.Open }

// upperStart is the latest known moment by which the belief had started.
func (iv Interval) upperStart() int64 {
	if iv.Elected && iv.ElectedAt > iv.Start {
		return iv.ElectedAt
	}
	return iv.Start
}

// Bounds tells Check what to accept.
type Bounds struct {
	// MaxTakeover is the longest takeover accepted, from one leader's End
	// to the next leader's OnElected; 0 accepts any.
	MaxTakeover time.Duration

	// StartAtSend starts each interval when the granting Acquire was sent
	// instead of when it returned: a wider interval, which also contains
	// the moment the store made the grant.
	StartAtSend bool

	// OpenEnd gives the end of an open interval (one with no recorded end,
	// such as that of a killed process), as a CLOCK_MONOTONIC reading, or
	// false if it does not know it. An open interval with no end given is
	// treated as never ending and reported in Report.Unended. See
	// EndOpenAt and EndOpenAtDeadline.
	OpenEnd func(Interval) (end int64, ok bool)
}

// EndOpenAt ends every open interval at the CLOCK_MONOTONIC reading at, for
// example the moment the test killed every remaining participant.
func EndOpenAt(at int64) func(Interval) (int64, bool) {
	return func(Interval) (int64, bool) { return at, true }
}

// EndOpenAtDeadline ends every open interval at its last successful
// Acquire or Renew's send time plus ttl: no later than the Elector's local
// deadline (which is that minus DriftMargin), at which it stops believing if
// its timers run. That is an upper bound for a process that was killed, or
// that lost its connections, but not for one that was paused (SIGSTOP): a
// paused process's timers do not fire, and it believes until it resumes.
func EndOpenAtDeadline(ttl time.Duration) func(Interval) (int64, bool) {
	return func(iv Interval) (int64, bool) {
		if iv.LastSent == 0 {
			return 0, false
		}
		return iv.LastSent + int64(ttl), true
	}
}

// Overlap is two intervals of one name that overlap.
type Overlap struct {
	First, Second Interval // First starts no later than Second
	Duration      time.Duration
}

func (o Overlap) String() string {
	return fmt.Sprintf("overlap of %v: %v and %v", o.Duration, o.First, o.Second)
}

// TermRegression is an interval whose term is not above that of every
// interval of its name that started before it.
type TermRegression struct {
	Previous Interval // the earlier interval with the greatest term
	Next     Interval
}

func (r TermRegression) String() string {
	return fmt.Sprintf("term %d after term %d: %v after %v", r.Next.Term, r.Previous.Term, r.Next, r.Previous)
}

// Takeover is the passage of leadership of one name from one leader to the
// next (grants never acted on are skipped).
type Takeover struct {
	From, To Interval
	// Gap is from From.End to To's OnElected (or To.Start if OnElected was
	// not recorded). It overstates the true gap by the delay with which
	// the Elector calls OnElected, and understates it by the delay with which
	// the end was recorded; both are scheduling delays of one goroutine.
	Gap time.Duration
}

func (t Takeover) String() string {
	return fmt.Sprintf("takeover in %v: %v then %v", t.Gap, t.From, t.To)
}

// Report is Check's verdict.
type Report struct {
	// Intervals are all the intervals, ordered by name, then Start.
	Intervals []Interval
	// Overlaps break invariant 1.
	Overlaps []Overlap
	// TermRegressions break invariant 2.
	TermRegressions []TermRegression
	// Takeovers are all the takeovers, in order.
	Takeovers []Takeover
	// SlowTakeovers are the Takeovers slower than Bounds.MaxTakeover.
	SlowTakeovers []Takeover
	// Unended are the open intervals Bounds.OpenEnd gave no end for.
	Unended []Interval
	// Invalid lists events that do not make sense together (a term granted
	// twice, an end without a start, ...): a bug in the recording or in
	// the store.
	Invalid []string
}

// OK reports whether the history passed: no overlap, no term regression,
// no slow takeover, no unexplained open interval, nothing invalid.
func (r Report) OK() bool {
	return len(r.Overlaps) == 0 && len(r.TermRegressions) == 0 && len(r.SlowTakeovers) == 0 &&
		len(r.Unended) == 0 && len(r.Invalid) == 0
}

// String lists what failed, one line each, or says that all passed.
func (r Report) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%d intervals, %d takeovers (%v)", len(r.Intervals), len(r.Takeovers), r.TakeoverSummary())
	for _, o := range r.Overlaps {
		fmt.Fprintf(&b, "\n%v", o)
	}
	for _, t := range r.TermRegressions {
		fmt.Fprintf(&b, "\n%v", t)
	}
	for _, t := range r.SlowTakeovers {
		fmt.Fprintf(&b, "\nslow %v", t)
	}
	for _, iv := range r.Unended {
		fmt.Fprintf(&b, "\nno end recorded or given: %v", iv)
	}
	for _, s := range r.Invalid {
		fmt.Fprintf(&b, "\ninvalid: %s", s)
	}
	return b.String()
}

// TakeoverGaps returns the Gap of every takeover, in order.
func (r Report) TakeoverGaps() []time.Duration {
	gaps := make([]time.Duration, len(r.Takeovers))
	for i, t := range r.Takeovers {
		gaps[i] = t.Gap
	}
	return gaps
}

// TakeoverSummary summarizes the takeover gaps.
func (r Report) TakeoverSummary() Summary { return Summarize(r.TakeoverGaps()) }

// Summary is the count, median, 99th percentile and maximum of durations.
type Summary struct {
	N             int
	P50, P99, Max time.Duration
}

func (s Summary) String() string {
	if s.N == 0 {
		return "none"
	}
	return fmt.Sprintf("n=%d p50=%v p99=%v max=%v", s.N, s.P50, s.P99, s.Max)
}

// Summarize returns the Summary of ds, with nearest-rank percentiles.
func Summarize(ds []time.Duration) Summary {
	if len(ds) == 0 {
		return Summary{}
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	rank := func(p float64) time.Duration {
		i := int(math.Ceil(p*float64(len(s)))) - 1
		return s[max(i, 0)]
	}
	return Summary{N: len(s), P50: rank(0.50), P99: rank(0.99), Max: s[len(s)-1]}
}

// Check builds the intervals of events (in any order; see Interval for how)
// and checks them against b: per election name, no two intervals overlap
// (intervals that only touch, one's End equal to the next's Start, do not),
// every interval's term is above that of every interval that started
// before it, and no takeover exceeds b.MaxTakeover.
func Check(events []Event, b Bounds) Report {
	type key struct {
		name, instance string
		term           uint64
	}
	type building struct {
		Interval
		sent, answered int64
		hasEnd         bool
	}
	var (
		rep   Report
		order []key
		byKey = make(map[key]*building)
	)
	for _, e := range events {
		k := key{e.Name, e.Instance, e.Term}
		iv := byKey[k]
		if iv == nil {
			iv = &building{Interval: Interval{Name: e.Name, Instance: e.Instance, Term: e.Term, End: math.MaxInt64}}
			byKey[k] = iv
			order = append(order, k)
		}
		switch e.Kind {
		case Granted:
			if iv.Granted {
				rep.Invalid = append(rep.Invalid, fmt.Sprintf("granted twice: %v", e))
				continue
			}
			iv.Granted, iv.sent, iv.answered = true, e.Sent, e.At
			iv.LastSent = max(iv.LastSent, e.Sent)
		case Renewed:
			iv.LastSent = max(iv.LastSent, e.Sent)
		case Elected:
			if iv.Elected {
				rep.Invalid = append(rep.Invalid, fmt.Sprintf("elected twice: %v", e))
				continue
			}
			iv.Elected, iv.ElectedAt = true, e.At
		case Ended, Demoted, Released:
			iv.End = min(iv.End, e.At)
			iv.hasEnd = true
		default:
			rep.Invalid = append(rep.Invalid, fmt.Sprintf("unknown kind: %v", e))
		}
	}

	byName := make(map[string][]Interval)
	var names []string
	for _, k := range order {
		iv := byKey[k]
		switch {
		case iv.Granted && b.StartAtSend:
			iv.Start = iv.sent
		case iv.Granted:
			iv.Start = iv.answered
		case iv.Elected:
			iv.Start = iv.ElectedAt
		default:
			rep.Invalid = append(rep.Invalid, fmt.Sprintf("neither granted nor elected: %v", iv.Interval))
			continue
		}
		if !iv.hasEnd {
			iv.Open = true
			if b.OpenEnd != nil {
				if end, ok := b.OpenEnd(iv.Interval); ok {
					iv.End = end
				}
			}
			if iv.End == math.MaxInt64 {
				rep.Unended = append(rep.Unended, iv.Interval)
			}
		}
		if iv.End < iv.Start {
			if iv.Granted {
				rep.Invalid = append(rep.Invalid, fmt.Sprintf("ends before it starts: %v", iv.Interval))
			} else {
				// OnDemoted can run before OnElected; without a grant
				// the start is a guess anyway.
				iv.Start = iv.End
			}
		}
		if _, ok := byName[iv.Name]; !ok {
			names = append(names, iv.Name)
		}
		byName[iv.Name] = append(byName[iv.Name], iv.Interval)
	}
	slices.Sort(names)

	for _, name := range names {
		ivs := byName[name]
		slices.SortStableFunc(ivs, func(a, b Interval) int {
			return cmp.Or(cmp.Compare(a.Start, b.Start), cmp.Compare(a.End, b.End))
		})
		rep.Intervals = append(rep.Intervals, ivs...)

		for i, a := range ivs {
			for _, c := range ivs[i+1:] {
				if c.Start >= a.End {
					break // sorted by Start: no later one overlaps a either
				}
				rep.Overlaps = append(rep.Overlaps, Overlap{First: a, Second: c, Duration: ns(min(a.End, c.End) - c.Start)})
			}
		}

		for i, top := 1, 0; i < len(ivs); i++ {
			if ivs[i].Term <= ivs[top].Term {
				rep.TermRegressions = append(rep.TermRegressions, TermRegression{Previous: ivs[top], Next: ivs[i]})
			} else {
				top = i
			}
		}

		var prev *Interval
		for i := range ivs {
			iv := &ivs[i]
			if !iv.led() {
				continue
			}
			if prev != nil && iv.Start >= prev.End {
				t := Takeover{From: *prev, To: *iv, Gap: ns(iv.upperStart() - prev.End)}
				rep.Takeovers = append(rep.Takeovers, t)
				if b.MaxTakeover > 0 && t.Gap > b.MaxTakeover {
					rep.SlowTakeovers = append(rep.SlowTakeovers, t)
				}
			}
			if prev == nil || iv.End > prev.End {
				prev = iv
			}
		}
	}
	return rep
}
