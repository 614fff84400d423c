package main

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"time"
)

// The rolling-deploy scenario (ours only): every instance of a group is
// replaced, one by one, by an instance of a new release at a higher
// priority, the new one starting before the old one stops (surge).
// Leadership should move exactly once, to the new release, and the group
// should never be without a leader for longer than a handover takes.

const scRolling = "rolling-deploy"

// deployReport is one rolling deploy.
type deployReport struct {
	// Release is the new release's priority; the old one's is one less.
	Release int `json:"release"`
	// LeaderStep is where the leader at the start fell in the order of
	// replacement (0: it was replaced first).
	LeaderStep int `json:"leader_step"`
	// Changes are the elections from the first new process's start until
	// a settling time after the last old one's exit (one per leadership
	// change); Reasons are their grant reasons (Lease.Reason), in order.
	Changes int      `json:"changes"`
	Reasons []string `json:"reasons"`
	// NewLeader: the leader at the end runs the new release.
	NewLeader bool `json:"new_leader"`
	// LongestGapMs is the longest stretch without a leader: from a
	// leader's OnDemoted to the next OnElected (0 without a change).
	LongestGapMs float64 `json:"longest_leaderless_ms"`
	// Overlaps are elections while another process still led (must be 0).
	Overlaps int `json:"overlaps,omitempty"`
	// TotalMs runs from the first new process's start to the last old
	// one's exit.
	TotalMs float64 `json:"total_ms"`
}

// exactlyOnce reports whether leadership moved once, to the new release.
func (d deployReport) exactlyOnce() bool {
	return d.Changes == 1 && d.NewLeader && d.Overlaps == 0
}

// measureRollingDeploy runs the setup's deploys on its group (of
// rollingSize processes, all of one release at the start). Deploy i starts
// release i+1 (priority i+1) beside release i: for each slot in turn, a
// new process starts, and once it campaigns and is enlisted the old one
// exits, handing over if it leads (Config.HandOverOnStop; see
// group.surge). The leader at the start is replaced at step
// 2i mod size (first, in the middle, last, ...), the others in slot order.
// A deploy starts after a random part of a renew interval, and ends a
// settling time (MinTenure, the TTL, plus two renew intervals: when a late
// priority handover would come) after the last old process exited. The
// samples are each deploy's longest leaderless stretch; Deploys has the
// whole account.
func measureRollingDeploy(g *group, r *Result) error {
	r.Trials = g.s.Deploys
	var totals []float64
	for i := range g.s.Deploys {
		d, err := g.rollingDeploy(i)
		if err != nil {
			r.Failures++
			r.Trials = i + 1
			return fmt.Errorf("deploy %d: %w", i, err)
		}
		r.Deploys = append(r.Deploys, d)
		r.SamplesMs = append(r.SamplesMs, d.LongestGapMs)
		totals = append(totals, d.TotalMs)
		g.b.logf("  %s deploy %d: leader replaced at step %d of %d; %d change(s) (%s), new release leads: %v; longest leaderless %.2f ms; %.1f s",
			g.s.Name, i, d.LeaderStep+1, len(g.members), d.Changes, strings.Join(d.Reasons, ", "), d.NewLeader, d.LongestGapMs, d.TotalMs/1000)
		if !d.exactlyOnce() {
			r.Notes = append(r.Notes, fmt.Sprintf("deploy %d: leadership changed %d times (%s), the new release leads at the end: %v, overlaps: %d",
				i, d.Changes, strings.Join(d.Reasons, ", "), d.NewLeader, d.Overlaps))
		}
	}
	once, changes := 0, make([]float64, 0, len(r.Deploys))
	for _, d := range r.Deploys {
		if d.exactlyOnce() {
			once++
		}
		changes = append(changes, float64(d.Changes))
	}
	r.Values = map[string]float64{"deploys": float64(len(r.Deploys)), "exactly_once": float64(once)}
	if len(r.Deploys) > 0 {
		t := summarize(totals)
		r.Values["changes_min"], r.Values["changes_max"] = slices.Min(changes), slices.Max(changes)
		r.Values["total_p50_ms"], r.Values["total_max_ms"] = t.P50, t.Max
	}
	return nil
}

// rollingDeploy runs deploy i (see measureRollingDeploy) and returns its
// account.
func (g *group) rollingDeploy(i int) (d deployReport, err error) {
	l, err := g.waitLeader()
	if err != nil {
		return d, err
	}
	g.phase()
	if l, err = g.waitLeader(); err != nil {
		return d, err
	}
	size := len(g.members)
	d.Release, d.LeaderStep = l.priority+1, (2*i)%size
	order := slices.DeleteFunc(slices.Clone(g.members), func(m *member) bool { return m == l })
	order = slices.Insert(order, d.LeaderStep, l)

	g.timeline, g.recording = nil, true
	defer func() { g.recording = false }()
	start := time.Now()
	for _, old := range order {
		if err := g.surge(old, d.Release); err != nil {
			return d, err
		}
	}
	d.TotalMs = float64(time.Since(start).Microseconds()) / 1000
	g.sleep(g.s.Timing.TTL.D() + 2*g.s.Timing.Renew.D())

	changes, longest, overlaps, leaderless := walkLeadership(g.timeline)
	d.Changes, d.Overlaps, d.LongestGapMs = len(changes), overlaps, ms(longest)
	for _, e := range changes {
		d.Reasons = append(d.Reasons, cmp.Or(e.reason, `""`))
	}
	if leaderless {
		return d, fmt.Errorf("nobody leads after the deploy (%s)", g.describe())
	}
	now := g.leader()
	d.NewLeader = now != nil && now.priority == d.Release
	return d, nil
}

// walkLeadership goes through a timeline in time order, from one leader at
// its start, and returns the elections, the longest stretch without a
// leader (ns, from a loss that left nobody leading to the next election),
// the elections made while another process still led, and whether nobody
// leads at its end.
func walkLeadership(tl []leadershipEvent) (elections []leadershipEvent, longest int64, overlaps int, leaderless bool) {
	tl = slices.Clone(tl)
	slices.SortStableFunc(tl, func(a, b leadershipEvent) int { return cmp.Compare(a.t, b.t) })
	leading := 1
	var since int64
	for _, e := range tl {
		if !e.elected {
			if leading--; leading == 0 {
				since = e.t
			}
			continue
		}
		elections = append(elections, e)
		if leading == 0 {
			longest = max(longest, e.t-since)
		} else {
			overlaps++
		}
		leading++
	}
	return elections, longest, overlaps, leading <= 0
}
