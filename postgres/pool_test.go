package postgres

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/internal/pgtest"
)

// TestStarvedPoolKeepsLeadership runs a leader on a pool of 3 connections,
// then has the service's own work hold all 3 for 3 TTLs: the store's
// statements go on its own connections, so the leader leads on throughout,
// on both strategies.
func TestStarvedPoolKeepsLeadership(t *testing.T) {
	t.Parallel()
	const ttl = 2 * time.Second
	for _, strategy := range []Strategy{StrategyLease, StrategyAdvisory} {
		t.Run(string(strategy), func(t *testing.T) {
			t.Parallel()
			connString := pgtest.NewDatabase(t)
			cfg, err := pgxpool.ParseConfig(connString)
			if err != nil {
				t.Fatal(err)
			}
			cfg.MaxConns = 3
			pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool.Close)
			if err := Migrate(callCtx(t), pool, Options{}); err != nil {
				t.Fatal(err)
			}
			store := storeFor(t, strategy, pool)
			var (
				mu     sync.Mutex
				losses []leader.LossReason
			)
			metrics := lossMetrics{lost: func(r leader.LossReason) {
				mu.Lock()
				defer mu.Unlock()
				losses = append(losses, r)
			}}
			e, err := leader.New(store, leader.Config{Name: "starved", TTL: ttl, Metrics: metrics, Logger: slog.New(slog.DiscardHandler)})
			if err != nil {
				t.Fatal(err)
			}
			electortest.Run(t, e)
			electortest.Eventually(t, 15*time.Second, "leadership", e.IsLeader)
			term := e.Status().Term

			// The service's own work takes every connection of its pool.
			conns := make([]*pgxpool.Conn, cfg.MaxConns)
			for i := range conns {
				if conns[i], err = pool.Acquire(callCtx(t)); err != nil {
					t.Fatal(err)
				}
			}
			var wg sync.WaitGroup
			for _, conn := range conns {
				wg.Go(func() {
					defer conn.Release()
					if _, err := conn.Exec(callCtx(t), "SELECT pg_sleep($1)", (3 * ttl).Seconds()); err != nil {
						t.Errorf("the service's work: %v", err)
					}
				})
			}
			electortest.Never(t, 3*ttl, "the leader to lose its leadership while the service's work holds its pool", func() bool {
				return !e.IsLeader()
			})
			wg.Wait()
			mu.Lock()
			defer mu.Unlock()
			if len(losses) > 0 || e.Status().Term != term {
				t.Errorf("leadership lost to a starved pool: losses %v, term %d then %d", losses, term, e.Status().Term)
			}
		})
	}
}

// lossMetrics is a leader.Metrics that reports each loss to lost.
type lossMetrics struct {
	leader.NopMetrics
	lost func(leader.LossReason)
}

func (m lossMetrics) Lost(_ string, r leader.LossReason) { m.lost(r) }

// TestCallsAreBoundedWithoutADeadline checks that a store call and Migrate
// made under context.Background() give up after Options.CallTimeout on a
// server that accepts connections and never answers.
func TestCallsAreBoundedWithoutADeadline(t *testing.T) {
	t.Parallel()
	pool := pgtest.OpenPool(t, "postgres://app@"+silentServer(t)+"/app?sslmode=disable")
	opts := Options{CallTimeout: 500 * time.Millisecond}

	start := time.Now()
	err := Migrate(context.Background(), pool, opts)
	if err == nil || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Migrate on a silent server: %v; want an error wrapping context.DeadlineExceeded", err)
	}
	if took := time.Since(start); took > 3*time.Second { // under DefaultConnectTimeout, which must not be what ends it
		t.Errorf("Migrate on a silent server took %v with CallTimeout %v", took, opts.CallTimeout)
	}

	store, err := NewLeaseStore(pool, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(store.Close)
	start = time.Now()
	_, _, err = store.Acquire(context.Background(), "silent", candidate("a"), time.Minute)
	if err == nil || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Acquire on a silent server: %v; want an error wrapping context.DeadlineExceeded", err)
	}
	if took := time.Since(start); took > 3*time.Second { // under DefaultConnectTimeout, which must not be what ends it
		t.Errorf("Acquire on a silent server took %v with CallTimeout %v", took, opts.CallTimeout)
	}
}

// silentServer listens on a local port until t ends, and accepts
// connections that it never answers. It returns the address.
func silentServer(t *testing.T) string {
	t.Helper()
	addr, _ := countingSilentServer(t)
	return addr
}

// countingSilentServer is silentServer, and also returns how many
// connections it has accepted so far.
func countingSilentServer(t *testing.T) (addr string, accepted func() int) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	var (
		mu    sync.Mutex
		conns []net.Conn
	)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c) // held open, never answered
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	return l.Addr().String(), func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(conns)
	}
}

// TestOwnPoolPingsOnlyLongIdleConnections checks the rule by which a
// store's own pool pings a connection before handing it out: only after a
// minute idle (a follower's attempt, once per TTL, and a successor's
// grant then cost one round trip, not two), unless the caller's pool has a
// rule of its own, which it keeps.
func TestOwnPoolPingsOnlyLongIdleConnections(t *testing.T) {
	t.Parallel()
	connString := pgtest.NewDatabase(t)
	for _, c := range []struct {
		what   string
		rule   func(context.Context, pgxpool.ShouldPingParams) bool
		idle   time.Duration
		pinged bool
	}{
		{"idle for a TTL", nil, 15 * time.Second, false},
		{"idle for over a minute", nil, 61 * time.Second, true},
		{"the caller's rule, which pings always", func(context.Context, pgxpool.ShouldPingParams) bool { return true }, time.Second, true},
	} {
		cfg, err := pgxpool.ParseConfig(connString)
		if err != nil {
			t.Fatal(err)
		}
		cfg.ShouldPing = c.rule
		pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		own, err := newOwnPool(pool, Options{MaxConns: 2}, &hostOrder{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(own.Close)
		if got := own.Config().ShouldPing(context.Background(), pgxpool.ShouldPingParams{IdleDuration: c.idle}); got != c.pinged {
			t.Errorf("%s: the store's own pool pings a connection idle for %v: %v; want %v", c.what, c.idle, got, c.pinged)
		}
	}
}
