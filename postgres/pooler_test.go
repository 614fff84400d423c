package postgres

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/internal/pgtest"
)

// TestLeaseStoreBehindPgBouncer checks that the lease strategy keeps working
// behind PgBouncer in transaction mode: its wake-ups say they are off, and
// followers take over at the lease's expiry instead.
func TestLeaseStoreBehindPgBouncer(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDatabase(t)
	if err := Migrate(callCtx(t), pgtest.OpenPool(t, url), Options{}); err != nil {
		t.Fatal(err)
	}
	pooled := pgtest.OpenPool(t, pgtest.PgBouncer(t, url, "transaction"))
	var logs electortest.LogBuffer
	s, err := NewLeaseStore(pooled, Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)

	const ttl = 2 * time.Second
	h := electortest.NewHistory()
	var es []*leader.Elector
	stops := map[*leader.Elector]func(){}
	for _, id := range []string{"a", "b"} {
		cfg := leader.Config{Name: "pooled", ID: id, TTL: ttl, Logger: slog.New(slog.DiscardHandler)}
		cfg.OnElected, cfg.OnDemoted = h.Hooks(t, id)
		e, err := leader.New(s, cfg)
		if err != nil {
			t.Fatal(err)
		}
		es = append(es, e)
		stops[e] = electortest.Run(t, e)
	}
	old := leaderOf(t, es, 10*time.Second)
	electortest.Eventually(t, 10*time.Second, "the wake-ups to say they are off", func() bool {
		return strings.Contains(logs.String(), "store wake-ups are off") && strings.Contains(logs.String(), "PgBouncer")
	})
	// A graceful stop releases the lease, but the follower hears nothing:
	// it tries again at the expiry it was told, within about a TTL.
	start := time.Now()
	stops[old]()
	var next *leader.Elector
	for _, e := range es {
		if e != old {
			next = e
		}
	}
	electortest.Eventually(t, 3*ttl, "the follower to take over", next.IsLeader)
	took := time.Since(start)
	t.Logf("behind PgBouncer (transaction mode), takeover after a release with wake-ups off: %v (TTL %v)", took, ttl)
	if took > ttl+time.Second {
		t.Errorf("takeover took %v; followers should try again at the expiry, within the TTL (%v)", took, ttl)
	}
}
