//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/leaderelect/leader/internal/pgtest"
)

// promotionTTL is the --ttl of the candidates across a promotion: short,
// as the promoted server grants nothing for a TTL after it first answers
// on its new timeline, and the old primary's leader stops its command
// only by its deadline.
const promotionTTL = 3 * time.Second

// TestRunAcrossAPromotion runs "leader run" across a PostgreSQL failover,
// with each strategy, as TestPromotionNeverElectsTwice runs Electors in the
// postgres package: three instances on a multi-host store URL that names
// the standby and then the primary's host, with
// target_session_attrs=read-write; replication is cut, so that the
// standby loses the leader's renewals for a TTL and then a graceful
// handover (SIGTERM to the leader) on the primary; the primary's host
// vanishes, the standby is promoted, and a fourth instance starts. From
// the children's own log (see checkTenures): no two commands ever run at
// once, each stopping before the next starts, and LEADER_TERM grows at
// every start, so no term is handed out twice and none goes back; and a
// command runs again within 4 TTL of the promotion. The old primary's
// leader stops its command by its deadline, a TTL after the host vanished.
func TestRunAcrossAPromotion(t *testing.T) {
	t.Parallel()
	for _, strategy := range []string{strategyLease, strategyAdvisory} {
		t.Run(strategy, func(t *testing.T) {
			t.Parallel()
			runAcrossAPromotion(t, strategy)
		})
	}
}

// runAcrossAPromotion runs one strategy's case of TestRunAcrossAPromotion.
func runAcrossAPromotion(t *testing.T, strategy string) {
	const ttl = promotionTTL
	e := newEnv(t)
	c := pgtest.NewReplicatedCluster(t, pgtest.ReplicationOptions{})
	store := multiHostURL(t, "", c.Standby(), c.PrimaryProxied())
	if out, stderr, code := e.run("migrate", "--store", store); code != 0 {
		t.Fatalf("migrate on %s: exit %d\n%s%s", store, code, out, stderr)
	}
	c.WaitReplayed(t)
	log := newChildLog(t, e)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("the children's log:\n%s", log)
		}
	})
	flags := []string{"--strategy", strategy, "--ttl", ttl.String()}
	procs := e.candidates(3, log, store, flags...)
	first := procs[exactlyStarted(t, log, 1, 20*time.Second, "the first command").fields[3]]
	c.WaitReplayed(t) // the standby has the first grant

	// Lost with the primary: the leader's renewals for a TTL (so that the
	// standby's copy of its lease has run out), and a graceful handover.
	c.CutReplication()
	time.Sleep(ttl)
	first.signal(syscall.SIGTERM)
	handedTo := exactlyStarted(t, log, 2, 20*time.Second, "the command of the leader after the handover")
	if code := first.wait(20 * time.Second); code != 0 {
		t.Errorf("the first leader, stopped by SIGTERM, exited %d, want 0", code)
	}

	// The primary's host vanishes; the standby is promoted; a fourth
	// instance starts, which has never seen the old primary.
	vanished := time.Now()
	c.VanishPrimary(t)
	c.Promote(t)
	promoted := time.Now()
	late := append([]string{"run", "--store", store, "--name", "e2e", "--id", "c3"}, flags...)
	procs["c3"] = e.with("CHILD_LOG=" + log.path).start(append(late, "--", "sh", filepath.Join(e.dir, "child.sh"))...)
	after := exactlyStarted(t, log, 3, 4*ttl, "a command after the promotion")
	stopped := log.stopAt(handedTo.pid)
	t.Logf("%s: the old primary's leader %s stopped its command %v after its host vanished; %s started its command %v after the promotion, with LEADER_TERM %s after %s",
		strategy, handedTo.fields[3], stopped.Sub(vanished).Round(time.Millisecond), after.fields[3],
		after.at.Sub(promoted).Round(time.Millisecond), after.fields[4], handedTo.fields[4])
	if stopped.IsZero() || stopped.Sub(vanished) > ttl+time.Second { // its last renewal was before the vanishing
		t.Errorf("the old primary's leader %s stopped its command %v after its host vanished, want within the TTL (%v)",
			handedTo.fields[3], stopped.Sub(vanished), ttl)
	}
	log.assertAtMostOneRunsFor(ttl)

	// Every instance stops on SIGTERM, on the promoted server too. (One
	// whose connections went to the vanished host may take a while to
	// exit: closing them waits for cancel requests that get no answer.)
	for _, p := range procs {
		if !p.exited() {
			p.signal(syscall.SIGTERM)
		}
	}
	for id, p := range procs {
		if code := p.wait(20 * time.Second); code != 0 {
			t.Errorf("%s, stopped by SIGTERM, exited %d, want 0", id, code)
		}
	}
	log.checkNoOverlap()
	checkTenures(t, log)
}

// tenure is one run of a child, from the child log.
type tenure struct {
	id          string // LEADER_ID
	term        string // LEADER_TERM
	start, stop time.Time
}

// exactlyStarted waits up to within for the n-th start in log (from 1),
// which what names, and returns it; it fails t if more children started.
func exactlyStarted(t *testing.T, log childLog, n int, within time.Duration, what string) childEvent {
	t.Helper()
	waitFor(t, within, what+" to start", func() bool { return len(log.starts()) >= n })
	starts := log.starts()
	if len(starts) != n {
		t.Fatalf("waiting for %s, %d children started, want %d", what, len(starts), n)
	}
	return starts[n-1]
}

// stopAt returns when the child pid logged its stop, or the zero time.
func (l childLog) stopAt(pid int) time.Time {
	for _, ev := range l.events() {
		if ev.kind == "stop" && ev.pid == pid {
			return ev.at
		}
	}
	return time.Time{}
}

// checkTenures checks the child log of instances that have all stopped:
// every child logged its stop; ordered by their starts, each child
// stopped before the next one started (so no two ran at once); and
// LEADER_TERM grew at every start, so no term was handed out twice, to
// two instances or to one, and no term went back.
func checkTenures(t *testing.T, log childLog) {
	t.Helper()
	var tenures []tenure
	for _, s := range log.starts() {
		tenures = append(tenures, tenure{id: s.fields[3], term: s.fields[4], start: s.at, stop: log.stopAt(s.pid)})
	}
	slices.SortFunc(tenures, func(a, b tenure) int { return a.start.Compare(b.start) })
	var summary []string
	for i, cur := range tenures {
		summary = append(summary, cur.id+" "+cur.term)
		if cur.stop.IsZero() {
			t.Errorf("%s's command (term %s) logged no stop", cur.id, cur.term)
		}
		if i == 0 {
			continue
		}
		prev := tenures[i-1]
		if !prev.stop.IsZero() && prev.stop.After(cur.start) {
			t.Errorf("%s's command (term %s) started at %v, before %s's (term %s) stopped at %v",
				cur.id, cur.term, cur.start, prev.id, prev.term, prev.stop)
		}
		if mustAtoi(t, cur.term) <= mustAtoi(t, prev.term) {
			t.Errorf("LEADER_TERM went from %s (%s) to %s (%s), want it to grow at every start", prev.term, prev.id, cur.term, cur.id)
		}
	}
	t.Logf("commands, in order (LEADER_ID LEADER_TERM): %s", strings.Join(summary, ", "))
}
