package faults_test

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/leaderelect/leader/internal/pgtest"
)

// maxPromotionTakeover bounds a takeover after a promotion, beyond the
// outage (from the primary's vanishing to the end of the promotion): the
// grace on a new timeline (a TTL after the promoted server first answered,
// see the Failover section of package postgres), a follower's next attempt
// (RetryInterval, TTL/3, plus jitter), a round trip, and slack for a loaded
// machine. It also bounds the time from the end of the promotion to the
// new leader's third write.
const maxPromotionTakeover = 2 * ttl

// Every strategy through a failover to an asynchronous standby that lost
// the last handover, a fresh replicated cluster per trial (the old primary
// is gone after a promotion), a few times each in CI mode, for as long as
// LEADER_SOAK says in soak mode. See the package documentation.
func TestPromotionFault(t *testing.T) {
	t.Parallel()
	rounds(t, ciTrials, soakTrials, func(t *testing.T, trials int) {
		for _, strategy := range strategies {
			t.Run(fmt.Sprintf("the %s store keeps one leader through a promotion of a standby that lost the last handover", strategy), func(t *testing.T) {
				t.Parallel()
				var r result
				for trial := range trials {
					t.Run(fmt.Sprint("trial ", trial), func(t *testing.T) { r.add(promotionTrial(t, strategy, trial)) })
				}
				record(t, "promotion", strategy, r)
			})
		}
	})
}

// promotionTrial runs one trial of the promotion fault on a private
// primary with an asynchronous streaming standby, and checks its history:
// candidates elect a leader through PrimaryProxied; replication is cut for
// a TTL, so that the standby's copy of that leader's lease runs out; the
// leader resigns, and another is elected on the primary alone; the
// primary's host vanishes, the standby is promoted, and a candidate that
// first connects then, to the promoted server, must take over with a
// greater term, within maxPromotionTakeover of the promotion, without
// overlapping the leader the standby never heard of. The leaders' work
// also makes fenced transactions on the primary of the moment: none that
// the old leader makes with its term after the promotion may commit.
func promotionTrial(t *testing.T, strategy string, trial int) result {
	c := pgtest.NewReplicatedCluster(t, pgtest.ReplicationOptions{})
	s := &databaseScenario{fault: databaseFault{name: "promotion"}, strategy: strategy, connString: c.PrimaryProxied()}
	migrate(t, c.Primary())
	// A fresh register per trial, on the shared cluster, which no fault
	// touches: each trial's terms start again on a fresh cluster.
	s.fence = setupFence(t, pgtest.OpenPool(t, pgtest.NewDatabase(t)))
	// The leaders' fenced transactions go to the election's database on
	// the primary of the moment: the primary, then, once the standby is
	// promoted, the promoted server. They reach the primary straight, not
	// through the proxy that its vanishing black-holes: once it is gone
	// they fail at once (the connection reset, or refused) instead of
	// hanging, and pgx, which waits up to 15 s for a server to close a
	// connection cut short, does not hold up the trial's end.
	primary := openTxPool(t, c.Primary())
	setupWorkTable(t, primary)
	dir := t.TempDir()
	var err error
	if s.fence.tx, err = newFencedWork(strategy, primary, dir, "electors"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.fence.tx.close() })
	for i := range candidates {
		s.cands = append(s.cands, s.newCandidate(t, dir, fmt.Sprint("e", i)))
	}

	first, firstTerm := s.awaitLeader(t, 1, awaitLeaderWithin)
	c.WaitReplayed(t) // the standby has first's grant
	// What follows is lost with the primary: first's renewals for a TTL,
	// so that the standby's copy of its lease runs out, and the handover.
	c.CutReplication()
	time.Sleep(ttl) // the standby falls behind
	if err := first.e.Resign(callCtx(t)); err != nil {
		t.Fatalf("%s resigning term %d: %v", first.id, firstTerm, err)
	}
	cur, term := s.awaitLeader(t, firstTerm+1, awaitLeaderWithin)
	// The fault's timing relative to the renewals, at random.
	time.Sleep(rand.N(maxInjectDelay + 1))
	injected := time.Now()
	c.VanishPrimary(t)
	c.Promote(t)
	promoted := time.Now()
	promotedPool := openTxPool(t, c.Standby())
	s.fence.tx.use(promotedPool)
	// Every fenced transaction invoked from now on goes to the promoted
	// server, where the leader's term, which the standby never heard of,
	// does not hold the lease.
	lostAt := monoNow(t)
	outage := promoted.Sub(injected)

	// A candidate that first connects after the promotion, to the
	// promoted server; the others still try the vanished primary.
	s.connString = c.Standby()
	newcomer := s.newCandidate(t, dir, "promoted")
	s.cands = append(s.cands, newcomer)
	next, nextTerm, _ := s.awaitOutcome(t, trial, cur, term, injected, promoted, false)
	took := time.Since(promoted)
	if next != newcomer {
		t.Errorf("trial %d: %s leads with term %d, not the candidate on the promoted server", trial, next.id, nextTerm)
	}
	if took > maxPromotionTakeover {
		t.Errorf("trial %d: %s wrote with term %d %v after the promotion, want at most %v", trial, next.id, nextTerm, took.Round(time.Millisecond), maxPromotionTakeover)
	}
	if st := cur.e.Status(); st.IsLeader && st.Term == term {
		t.Errorf("trial %d: %s still believes it leads with term %d after %s was elected with term %d", trial, cur.id, term, next.id, nextTerm)
	}
	s.fence.lateWrite(t, trial, cur.id, term, nextTerm)
	// The old leader's fenced transaction after the promotion, on the
	// promoted server, whatever its work did meanwhile.
	if _, err := s.fence.tx.write(callCtx(t), cur.id, term, lateTxValue(cur.id, term)); err != nil {
		t.Fatal(err)
	}
	if reason, at, ok := cur.losses.firstAfter(injected); !ok {
		t.Errorf("trial %d: %s lost term %d but reported no loss", trial, cur.id, term)
	} else {
		t.Logf("trial %d: %s took over from %s (term %d, lost on the standby) with term %d, %v after the promotion (outage %v); %s stepped down %v after its server vanished (%s)",
			trial, next.id, cur.id, term, nextTerm, took.Round(time.Millisecond), outage.Round(time.Millisecond), cur.id, at.Sub(injected).Round(time.Millisecond), reason)
	}

	s.stop(t)
	r, rep := s.check(t, dir, 1, []uint64{term}, outage+maxPromotionTakeover)
	ops, err := loadTxOps(dir)
	if err != nil {
		t.Fatal(err)
	}
	r.fenceTx = checkFencedWork(t, promotedPool, ops, rep.Intervals, []txTrial{{
		fault: "promotion", strategy: strategy, trial: trial,
		deposed:   tenure{cur.id, term},
		successor: tenure{next.id, nextTerm},
		lostAt:    lostAt,
		wantValue: lateTxValue(cur.id, term),
	}})
	return r
}
