//go:build unix

package faults_test

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/leaderelect/leader/internal/history"
)

// stepDownSlack is how long after its stop point a faulted leader may
// still be recorded as believing it leads: for its stop timer to fire and
// the end to be recorded on a loaded machine.
const stepDownSlack = 200 * time.Millisecond

// checkStepDown fails t unless each faulted leader stopped believing by
// its stop point (its local deadline less StopGrace) plus stepDownSlack:
// its last successful call was sent before the fault, so its stop point
// is at most TTL - DriftMargin - StopGrace after it.
func checkStepDown(t *testing.T, rep history.Report, fs []faulted) {
	t.Helper()
	const bound = ttl - driftMargin - stopGrace + stepDownSlack
	for _, f := range fs {
		iv, ok := interval(rep, f.name, f.id, f.term)
		switch {
		case !ok:
			t.Errorf("no interval of %s with term %d in the history", f.id, f.term)
		case iv.End-f.at > int64(bound):
			t.Errorf("%s with term %d stopped believing %v after the fault, later than its stop point allows (at most %v after it, plus %v): %v",
				f.id, f.term, time.Duration(iv.End-f.at), ttl-driftMargin-stopGrace, stepDownSlack, iv)
		default:
			t.Logf("%s with term %d stepped down %v after the fault", f.id, f.term, time.Duration(iv.End-f.at).Round(time.Millisecond))
		}
	}
}

// The leader's client is partitioned from etcd by toxiproxy, on its link
// to the one member it knows: every connection closed and reset (cut), or
// black-holed. See the package documentation.
func TestClientPartition(t *testing.T) {
	t.Parallel()
	rounds(t, func(t *testing.T, trials int) {
		for _, f := range []linkFault{cutLink, blackholeLink} {
			t.Run(f.name, func(t *testing.T) {
				t.Parallel()
				record(t, "partition-"+f.name, runLinkFault(t, f, trials))
			})
		}
	})
}

// The leader's client link is slowed down by toxiproxy: every byte
// delayed by clientDelay each way. See the package documentation.
func TestClientDelay(t *testing.T) {
	t.Parallel()
	rounds(t, func(t *testing.T, trials int) {
		record(t, "client-delay", runLinkFault(t, delayLink, trials))
	})
}

// The etcd member the leader's client talks to is killed with SIGKILL:
// with one endpoint per client (its own member), and with every member's.
func TestMemberKilled(t *testing.T) {
	t.Parallel()
	rounds(t, func(t *testing.T, trials int) {
		t.Run("own-endpoint", func(t *testing.T) {
			t.Parallel()
			record(t, "member-kill-own-endpoint", runOwnMemberKill(t, trials))
		})
		t.Run("all-endpoints", func(t *testing.T) {
			t.Parallel()
			record(t, "member-kill-all-endpoints", runMemberKillAllEndpoints(t, trials))
		})
	})
}

// runLinkFault runs trials of fault f on the leader's link, on clients
// that reach one member each through a link of their own; then the link
// heals.
func runLinkFault(t *testing.T, f linkFault, trials int) result {
	return runCutOff(t, ownLink, trials, func(_ *env, c *candidate) (heal func()) {
		c.link.inject(t, f)
		return func() { c.link.heal(t) }
	})
}

// runOwnMemberKill runs trials that kill the leader's member with
// SIGKILL, on clients that know one member each, which cuts the leader
// off from etcd; then the member is restarted and the cluster waited on
// to be healthy.
func runOwnMemberKill(t *testing.T, trials int) result {
	return runCutOff(t, ownMember, trials, func(v *env, c *candidate) (heal func()) {
		m := v.cluster.Member(c.member)
		m.Kill()
		return func() {
			m.Restart()
			if err := v.cluster.WaitHealthy(timeout(t, healthyWithin)); err != nil {
				t.Fatal(err)
			}
		}
	})
}

// runCutOff runs trials of a fault that cuts the leader off from etcd, on
// clients in mode (ownMember or ownLink: they know one member each):
// inject faults the leader and returns how to heal the fault. The leader
// must step down by its stop point (see checkStepDown) and another take
// over with a greater term within maxTakeover, and the leader must not be
// elected again meanwhile; then the fault is healed.
func runCutOff(t *testing.T, mode endpoints, trials int, inject func(v *env, c *candidate) (heal func())) result {
	v := newEnv(t, mode)
	var fs []faulted
	cur, term := v.nextLeader(0, 30*time.Second)
	if cur == nil {
		t.FailNow()
	}
	for trial := range trials {
		if cur, term = v.settle(cur, term); cur == nil {
			break
		}
		at := now(t)
		heal := inject(v, cur)
		fs = append(fs, faulted{election, cur.id, term, at})
		next, nextTerm := v.nextLeader(term, maxTakeover+2*ttl)
		if next == nil {
			break
		}
		if next == cur {
			t.Errorf("trial %d: %s, cut off from etcd, was elected again with term %d", trial, cur.id, nextTerm)
		}
		if cur.e.IsLeader() {
			t.Errorf("trial %d: %s still believes it leads after %s was elected with term %d", trial, cur.id, next.id, nextTerm)
		}
		v.lateWrite(trial, cur.id, term, nextTerm)
		heal()
		cur, term = next, nextTerm
	}
	v.stopAll()
	r, rep := v.check(history.Bounds{MaxTakeover: maxTakeover}, fs)
	checkStepDown(t, rep, fs)
	r.trials = len(fs) // the trials that injected their fault
	return r
}

// runMemberKillAllEndpoints runs trials that kill a member while every
// client knows every member: the cluster's Raft leader in even trials, a
// follower in odd ones. Once the cluster has a leader again, the Elector
// leader may lead on with its term (its client moved to a live member in
// time: it must then go on writing) or step down and be taken over; then
// the member is restarted.
func runMemberKillAllEndpoints(t *testing.T, trials int) result {
	v := newEnv(t, allMembers)
	var fs []faulted
	ledOn := 0
	cur, term := v.nextLeader(0, 30*time.Second)
	if cur == nil {
		t.FailNow()
	}
	for trial := range trials {
		if cur, term = v.settle(cur, term); cur == nil {
			break
		}
		lead, err := v.cluster.LeaderIndex(timeout(t, 10*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		idx := lead
		if trial%2 == 1 {
			idx = (lead + 1 + rand.N(members-1)) % members
		}
		at := now(t)
		v.cluster.Member(idx).Kill()
		if _, err := v.cluster.LeaderIndex(timeout(t, 10*time.Second)); err != nil {
			t.Fatalf("trial %d: %v", trial, err)
		}
		before := v.written(term)
		time.Sleep(ttl + ttl/2)
		if st := cur.e.Status(); st.IsLeader && st.Term == term && v.written(term) > before {
			ledOn++
			t.Logf("trial %d: member %d (Raft leader %v) killed; %s led on with term %d", trial, idx, idx == lead, cur.id, term)
		} else {
			fs = append(fs, faulted{election, cur.id, term, at})
			next, nextTerm := v.nextLeader(term, maxTakeover+2*ttl)
			if next == nil {
				break
			}
			if next != cur && cur.e.Status().Term == term && cur.e.IsLeader() {
				t.Errorf("trial %d: %s still believes it leads with term %d after %s was elected with term %d", trial, cur.id, term, next.id, nextTerm)
			}
			v.lateWrite(trial, cur.id, term, nextTerm)
			t.Logf("trial %d: member %d (Raft leader %v) killed; %s (term %d) taken over by %s (term %d)", trial, idx, idx == lead, cur.id, term, next.id, nextTerm)
			cur, term = next, nextTerm
		}
		v.cluster.Member(idx).Restart()
		if err := v.cluster.WaitHealthy(timeout(t, healthyWithin)); err != nil {
			t.Fatalf("trial %d: %v", trial, err)
		}
	}
	v.stopAll()
	r, _ := v.check(history.Bounds{MaxTakeover: maxTakeover}, fs)
	r.trials, r.ledOn = len(fs)+ledOn, ledOn // the trials that injected their fault
	return r
}

// Two of the three members are stopped (SIGTERM) or paused (SIGSTOP) for
// 2 to 3 TTL, then restarted or resumed.
func TestQuorumLoss(t *testing.T) {
	t.Parallel()
	rounds(t, func(t *testing.T, trials int) {
		for _, how := range []string{"stop", "pause"} {
			t.Run(how, func(t *testing.T) {
				t.Parallel()
				record(t, "quorum-loss-"+how, runQuorumLoss(t, how, trials))
			})
		}
	})
}

// runQuorumLoss runs trials of a loss of quorum: two members stopped or
// paused (the Raft leader and a follower in even trials, both followers
// in odd ones) for 2 to 3 TTL. From the moment the second is down plus a
// TTL until they are brought back, nobody may believe it leads; after
// the cluster is healthy again a leader with a greater term must be
// elected.
func runQuorumLoss(t *testing.T, how string, trials int) result {
	v := newEnv(t, allMembers)
	type window struct{ from, to int64 }
	var (
		fs        []faulted
		windows   []window
		maxOutage time.Duration
	)
	cur, term := v.nextLeader(0, 30*time.Second)
	if cur == nil {
		t.FailNow()
	}
	for trial := range trials {
		if cur, term = v.settle(cur, term); cur == nil {
			break
		}
		lead, err := v.cluster.LeaderIndex(timeout(t, 10*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		down := []int{lead, (lead + 1 + rand.N(members-1)) % members}
		if trial%2 == 1 {
			down = []int{(lead + 1) % members, (lead + 2) % members}
		}
		var outageStart int64
		injected := time.Now()
		for i, idx := range down {
			m := v.cluster.Member(idx)
			if how == "stop" {
				m.Stop() // returns once the member has exited
			} else {
				m.Pause()
			}
			if i == len(down)-1 {
				outageStart = now(t)
			}
		}
		fs = append(fs, faulted{election, cur.id, term, outageStart})
		t.Logf("trial %d: members %v down %v after the first signal", trial, down, time.Since(injected).Round(time.Millisecond))
		hold := 2*ttl + rand.N(ttl)
		// Watch as it happens too: a TTL after the quorum is gone, every
		// leader's deadline has passed.
		quiet := time.Duration(outageStart) + ttl
		seen := false // report one leader seen per trial
		for end := time.Duration(outageStart) + hold; ; {
			at := time.Duration(now(t))
			if at >= end {
				break
			}
			if at > quiet && !seen {
				for _, c := range v.all() {
					if c.e.IsLeader() {
						seen = true
						t.Errorf("trial %d: %s believes it leads %v into a loss of quorum", trial, c.id, at-time.Duration(outageStart))
					}
				}
			}
			time.Sleep(10 * time.Millisecond)
		}
		recoverAt := now(t)
		for _, idx := range down {
			if how == "stop" {
				v.cluster.Member(idx).Restart()
			} else {
				v.cluster.Member(idx).Resume()
			}
		}
		if err := v.cluster.WaitHealthy(timeout(t, healthyWithin)); err != nil {
			t.Fatalf("trial %d: %v", trial, err)
		}
		outage := time.Duration(now(t) - outageStart)
		maxOutage = max(maxOutage, outage)
		windows = append(windows, window{outageStart + int64(ttl), recoverAt})
		next, nextTerm := v.nextLeader(term, maxTakeover+2*ttl)
		if next == nil {
			break
		}
		v.lateWrite(trial, cur.id, term, nextTerm)
		t.Logf("trial %d: members %v %s (Raft leader %d) for %v, healthy after %v; %s (term %d) then %s (term %d)",
			trial, down, map[string]string{"stop": "stopped", "pause": "paused"}[how], lead, hold, outage.Round(time.Millisecond), cur.id, term, next.id, nextTerm)
		cur, term = next, nextTerm
	}
	v.stopAll()
	r, rep := v.check(history.Bounds{MaxTakeover: maxTakeover + maxOutage}, fs)
	for i, w := range windows {
		for _, iv := range rep.Intervals {
			if (iv.Elected || iv.Open) && iv.Start < w.to && iv.End > w.from {
				r.overlaps++
				t.Errorf("trial %d: a leadership while the cluster could not commit (from a TTL into the loss of quorum, %d, until recovery, %d): %v", i, w.from, w.to, iv)
			}
		}
	}
	checkStepDown(t, rep, fs)
	r.trials = len(fs) // the trials that injected their fault
	return r
}
