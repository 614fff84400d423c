package postgres

import (
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/internal/pgtest"
)

// TestPromotionNeverElectsTwice promotes a streaming standby after its
// primary's host vanished, with each strategy, for an asynchronous standby
// that lost the last handover and a synchronous one that did not. The
// leader granted on the old primary believes it leads until its local
// deadline; a candidate that first connects after the promotion must not
// be elected before that (the grace after a new timeline, see
// epochCTEs), and its term must be above every term the old primary
// handed out, lost ones included. The history's hooks fail the test on an
// overlap or a term that does not grow.
//
// It runs one trial of each case, and LEADER_SOAK_PROMOTIONS trials of
// the asynchronous case per strategy when that is set, several at once (go
// test's -parallel); with -v it prints a table of the failures and of the
// takeover times after the promotion:
//
//	LEADER_SOAK_PROMOTIONS=100 go test -race -count=1 -run TestPromotionNeverElectsTwice -parallel 6 -timeout 90m -v ./postgres/
func TestPromotionNeverElectsTwice(t *testing.T) {
	t.Parallel()
	n, _ := strconv.Atoi(os.Getenv("LEADER_SOAK_PROMOTIONS"))
	n = max(n, 1)
	type result struct {
		failed bool
		trial  promotionResult
	}
	var (
		mu      sync.Mutex
		results = map[Strategy][]result{}
	)
	t.Run("trials", func(t *testing.T) {
		for _, strategy := range []Strategy{StrategyLease, StrategyAdvisory} {
			t.Run(fmt.Sprintf("%s, synchronous standby", strategy), func(t *testing.T) {
				t.Parallel()
				promotion(t, strategy, true)
			})
			for i := range n {
				t.Run(fmt.Sprintf("%s, asynchronous standby that lost the last handover, %d", strategy, i), func(t *testing.T) {
					t.Parallel()
					var r promotionResult
					t.Cleanup(func() {
						mu.Lock()
						defer mu.Unlock()
						results[strategy] = append(results[strategy], result{failed: t.Failed(), trial: r})
					})
					r = promotion(t, strategy, false)
				})
			}
		}
	})
	t.Logf("%d promotion trials per strategy (asynchronous standby that lost the last handover; TTL %v):", n, promotionTTL)
	t.Logf("| strategy | trials | failed (overlap, repeated or regressed term) | takeover after promotion p50 / p99 / max | new leader elected after the old one stepped down, min |")
	t.Logf("|---|---|---|---|---|")
	for _, strategy := range []Strategy{StrategyLease, StrategyAdvisory} {
		var took, margin []time.Duration
		failed := 0
		for _, r := range results[strategy] {
			if r.failed {
				failed++
				continue
			}
			took = append(took, r.trial.took)
			margin = append(margin, r.trial.margin)
		}
		slices.Sort(took)
		slices.Sort(margin)
		q := func(d []time.Duration, p float64) time.Duration {
			if len(d) == 0 {
				return 0
			}
			return d[min(len(d)-1, int(p*float64(len(d))))].Round(time.Millisecond)
		}
		t.Logf("| %s | %d | %d | %v / %v / %v | %v |", strategy, len(results[strategy]), failed,
			q(took, 0.5), q(took, 0.99), q(took, 1), q(margin, 0))
	}
}

// promotionTTL is the TTL of the promotion trials.
const promotionTTL = 3 * time.Second

// promotionResult is what one promotion trial measured: how long after
// the promotion the new candidate was elected, and how long after the
// old primary's last leader stepped down.
type promotionResult struct {
	took, margin time.Duration
}

// promotion runs one trial of TestPromotionNeverElectsTwice.
func promotion(t *testing.T, strategy Strategy, sync bool) promotionResult {
	const ttl = promotionTTL
	c := pgtest.NewReplicatedCluster(t, pgtest.ReplicationOptions{Synchronous: sync})
	if err := Migrate(callCtx(t), pgtest.OpenPool(t, c.Primary()), Options{}); err != nil {
		t.Fatal(err)
	}
	c.WaitReplayed(t)
	h := electortest.NewHistory()
	elector := func(id string, pool *pgxpool.Pool) (*leader.Elector, func()) {
		cfg := leader.Config{Name: "promoted", ID: id, TTL: ttl, Logger: slog.New(slog.DiscardHandler)}
		cfg.OnElected, cfg.OnDemoted = h.Hooks(t, id)
		e, err := leader.New(storeFor(t, strategy, pool), cfg)
		if err != nil {
			t.Fatal(err)
		}
		return e, electortest.Run(t, e)
	}

	// a leads on the primary, and the standby has its grant.
	a, stopA := elector("a", pgtest.OpenPool(t, c.PrimaryProxied()))
	electortest.Eventually(t, 20*time.Second, "a to lead", a.IsLeader)
	c.WaitReplayed(t)
	if !sync {
		// What follows is lost with the primary: a's renewals for a TTL
		// (so that the standby's copy of a's lease has run out), and the
		// handover.
		c.CutReplication()
		time.Sleep(ttl)
	}
	// A graceful handover from a to b on the primary.
	b, _ := elector("b", pgtest.OpenPool(t, c.PrimaryProxied()))
	stopA()
	electortest.Eventually(t, 20*time.Second, "b to lead", b.IsLeader)
	bTerm := b.Status().Term

	// The primary's host vanishes; the standby is promoted.
	c.VanishPrimary(t)
	c.Promote(t)
	promoted := time.Now()

	// A candidate that first connects after the promotion.
	cand, _ := elector("c", pgtest.OpenPool(t, c.Standby()))
	electortest.Eventually(t, 6*ttl, "c to lead on the promoted standby", cand.IsLeader)
	electortest.Eventually(t, 10*time.Second, "c's OnElected", func() bool {
		_, ok := h.Find(func(e electortest.Event) bool { return e.Instance == "c" && e.Elected })
		return ok
	})
	if b.IsLeader() {
		t.Errorf("b still believes it leads (term %d) after c was elected", bTerm)
	}
	cTerm := cand.Status().Term
	t.Logf("b led with term %d on the old primary; c was elected %v after the promotion with term %d",
		bTerm, time.Since(promoted).Round(time.Millisecond), cTerm)
	if cTerm <= bTerm {
		t.Errorf("c's term %d is not above b's %d, granted on the old primary", cTerm, bTerm)
	}
	bDemoted, ok := h.Find(func(e electortest.Event) bool { return e.Instance == "b" && !e.Elected })
	cElected, _ := h.Find(func(e electortest.Event) bool { return e.Instance == "c" && e.Elected })
	if !ok || !bDemoted.At.Before(cElected.At) {
		t.Errorf("b demoted at %v, not before c was elected at %v", bDemoted.At, cElected.At)
	}
	return promotionResult{took: cElected.At.Sub(promoted), margin: cElected.At.Sub(bDemoted.At)}
}
