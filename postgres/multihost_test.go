package postgres

import (
	"log/slog"
	"net"
	"net/url"
	"strconv"
	"strings"
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
	url := multiHostURL(t, c.Primary(), hostPort(t, c.Standby()), hostPort(t, c.Primary()))
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

// TestFailoverWithTheVanishedPrimaryListedFirst runs, with each strategy,
// a leader and a follower, each on a store and a pool of its own, on a
// connection string that lists the primary (through a proxy) before its
// streaming standby, with target_session_attrs=read-write and no
// connect_timeout: a static HA configuration lists the dead host first
// after about half of all failovers. The primary's host then vanishes (its
// connections neither answer nor close, and new ones are held) and the
// standby is promoted. One of the two must lead again, on the promoted
// server, within two TTLs and a few seconds: the stores must neither wait
// out a connect timeout on the vanished host for each new connection, nor
// let a call's short deadline end every connection attempt there before
// the standby is tried (then nobody is ever elected again).
func TestFailoverWithTheVanishedPrimaryListedFirst(t *testing.T) {
	t.Parallel()
	for _, strategy := range []Strategy{StrategyLease, StrategyAdvisory} {
		t.Run(string(strategy), func(t *testing.T) {
			t.Parallel()
			const ttl = 3 * time.Second
			c := pgtest.NewReplicatedCluster(t, pgtest.ReplicationOptions{})
			if err := Migrate(callCtx(t), pgtest.OpenPool(t, c.Primary()), Options{}); err != nil {
				t.Fatal(err)
			}
			c.WaitReplayed(t)
			url := multiHostURL(t, c.Primary(), hostPort(t, c.PrimaryProxied()), hostPort(t, c.Standby()))
			h := electortest.NewHistory()
			var es []*leader.Elector
			for _, id := range []string{"a", "b"} {
				cfg := leader.Config{Name: "listed-first", ID: id, TTL: ttl, Logger: slog.New(slog.DiscardHandler)}
				cfg.OnElected, cfg.OnDemoted = h.Hooks(t, id)
				e, err := leader.New(storeFor(t, strategy, pgtest.OpenPool(t, url)), cfg)
				if err != nil {
					t.Fatal(err)
				}
				electortest.Run(t, e)
				es = append(es, e)
			}
			electortest.Eventually(t, 20*time.Second, "a leader on the primary", func() bool { return len(electortest.Leaders(es)) == 1 })
			first := electortest.Leaders(es)[0].Status()
			electortest.Eventually(t, 20*time.Second, "the follower to know the leader", func() bool {
				return es[0].Status().Leader == first.ID && es[1].Status().Leader == first.ID
			})
			// No connection is being opened, nor the grant announced,
			// when the host vanishes: one caught half-way waits out the
			// connect timeout there.
			time.Sleep(ttl / 3)
			before := first.Term

			c.VanishPrimary(t)
			c.Promote(t)
			promoted := time.Now()
			elected := func() (electortest.Event, bool) {
				return h.Find(func(e electortest.Event) bool { return e.Elected && e.Term > before })
			}
			// Waits well past the bound, so that a slow takeover is
			// measured rather than only refused.
			electortest.Eventually(t, 30*time.Second, "a leader on the promoted standby", func() bool {
				_, ok := elected()
				return ok
			})
			e, _ := elected()
			took := e.At.Sub(promoted)
			t.Logf("%s elected with term %d, %v after the promotion (TTL %v)", e.Instance, e.Term, took.Round(time.Millisecond), ttl)
			// The TTL of the grace on the new timeline, counted from a
			// candidate's first statement there: its first call on the
			// vanished host comes within a TTL (a follower calls once per
			// TTL), and is cut short after a RenewInterval; then a retry.
			// Not a connect timeout on the vanished host per new
			// connection.
			if bound := 2*ttl + 3*time.Second; took > bound {
				t.Errorf("%s elected %v after the promotion; want within %v", e.Instance, took, bound)
			}
		})
	}
}

// multiHostURL returns a connection string with the user, password and
// database of template that names the hosts ("host:port") given, in
// their order, with target_session_attrs=read-write.
func multiHostURL(t *testing.T, template string, hosts ...string) string {
	t.Helper()
	cfg, err := pgconn.ParseConfig(template)
	if err != nil {
		t.Fatal(err)
	}
	u := url.URL{Scheme: "postgres", User: url.UserPassword(cfg.User, cfg.Password), Host: strings.Join(hosts, ","), Path: "/" + cfg.Database,
		RawQuery: "sslmode=disable&target_session_attrs=read-write"}
	if cfg.Password == "" {
		u.User = url.User(cfg.User)
	}
	return u.String()
}

// hostPort returns the host and port of connString, as "host:port".
func hostPort(t *testing.T, connString string) string {
	t.Helper()
	cfg, err := pgconn.ParseConfig(connString)
	if err != nil {
		t.Fatal(err)
	}
	return net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port)))
}
