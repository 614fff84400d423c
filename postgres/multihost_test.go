package postgres

import (
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/internal/pgtest"
)

// TestMultiHostURLFindsThePrimary runs Electors on a connection string
// that names a streaming standby before its primary, with
// target_session_attrs=read-write, as an HA setup's would: the stores
// reach the primary, and an Elector of each strategy leads (their grants
// are writes, which the standby refuses).
func TestMultiHostURLFindsThePrimary(t *testing.T) {
	t.Parallel()
	c := pgtest.NewReplicatedCluster(t, pgtest.ReplicationOptions{})
	primary, err := pgconn.ParseConfig(c.Primary())
	if err != nil {
		t.Fatal(err)
	}
	standby, err := pgconn.ParseConfig(c.Standby())
	if err != nil {
		t.Fatal(err)
	}
	url := fmt.Sprintf("postgres://%s@%s:%d,%s:%d/%s?sslmode=disable&target_session_attrs=read-write",
		primary.User, standby.Host, standby.Port, primary.Host, primary.Port, primary.Database)
	pool := pgtest.OpenPool(t, url)
	if err := Migrate(callCtx(t), pool, Options{}); err != nil {
		t.Fatalf("Migrate on %s: %v", url, err)
	}
	lease, err := NewLeaseStore(pool, Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(lease.Close)
	advisory := setupAdvisory(t, pool, Options{})
	for _, s := range []struct {
		name  string
		store leader.Store
	}{{"lease", lease}, {"advisory", advisory}} {
		e, err := leader.New(s.store, leader.Config{Name: "ha-" + s.name, TTL: 5 * time.Second, Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		electortest.Run(t, e)
		electortest.Eventually(t, 20*time.Second, s.name+" Elector to lead through a multi-host URL", e.IsLeader)
	}
}

// TestLeaderStepsDownWhenItsServerVanishes runs a leader of each strategy
// on a primary whose host then vanishes: its connections go silent, with
// no FIN or RST, and the server stops. The leader steps down by its local
// deadline, a TTL at most after its last renewal, without waiting for any
// client or TCP timeout.
func TestLeaderStepsDownWhenItsServerVanishes(t *testing.T) {
	t.Parallel()
	for _, strategy := range []Strategy{StrategyLease, StrategyAdvisory} {
		t.Run(string(strategy), func(t *testing.T) {
			t.Parallel()
			c := pgtest.NewReplicatedCluster(t, pgtest.ReplicationOptions{})
			pool := pgtest.OpenPool(t, c.PrimaryProxied())
			if err := Migrate(callCtx(t), pool, Options{}); err != nil {
				t.Fatal(err)
			}
			store := storeFor(t, strategy, pool)
			const ttl = 3 * time.Second
			e, err := leader.New(store, leader.Config{Name: "vanish", TTL: ttl, Logger: slog.New(slog.DiscardHandler)})
			if err != nil {
				t.Fatal(err)
			}
			electortest.Run(t, e)
			electortest.Eventually(t, 20*time.Second, "leadership", e.IsLeader)
			vanished := time.Now()
			c.VanishPrimary(t)
			electortest.Eventually(t, 3*ttl, "the leader to step down", func() bool { return !e.IsLeader() })
			took := time.Since(vanished)
			t.Logf("stepped down %v after the primary vanished (TTL %v)", took.Round(time.Millisecond), ttl)
			if took > ttl+time.Second { // its last renewal was before the vanishing
				t.Errorf("stepped down %v after the primary vanished; want within the TTL (%v)", took, ttl)
			}
		})
	}
}
