package postgres

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/internal/pgtest"
	"github.com/leaderelect/leader/leadertest"
)

// leakCheck collects every log line and every error text of a test, and
// checks when the test ends that none shows a secret.
type leakCheck struct {
	t       *testing.T
	secrets []string
	logs    electortest.LogBuffer

	mu   sync.Mutex
	errs []string // "what: error"
}

// newLeakCheck returns a leakCheck for secrets, which checks when t ends.
func newLeakCheck(t *testing.T, secrets ...string) *leakCheck {
	c := &leakCheck{t: t, secrets: secrets}
	t.Cleanup(c.verify)
	return c
}

// logger returns a debug-level logger into c.
func (c *leakCheck) logger(instance string) *slog.Logger {
	return slog.New(slog.NewTextHandler(&c.logs, &slog.HandlerOptions{Level: slog.LevelDebug})).With("instance", instance)
}

// failed records err, the outcome of what, and fails the test if it is nil:
// every call checked here is made to fail.
func (c *leakCheck) failed(what string, err error) {
	c.t.Helper()
	if err == nil {
		c.t.Errorf("%s succeeded; it was meant to fail", what)
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.errs = append(c.errs, what+": "+err.Error(), what+" (%+v): "+fmt.Sprintf("%+v", err))
}

// waitLogged waits until the logs hold at least n lines that contain s.
func (c *leakCheck) waitLogged(s string, n int) {
	c.t.Helper()
	electortest.Eventually(c.t, 20*time.Second, fmt.Sprintf("%d log lines saying %q", n, s), func() bool {
		return strings.Count(c.logs.String(), s) >= n
	})
}

func (c *leakCheck) verify() {
	logs := c.logs.String()
	c.mu.Lock()
	errs := c.errs
	c.mu.Unlock()
	for _, secret := range c.secrets {
		for _, line := range strings.Split(logs, "\n") {
			if strings.Contains(line, secret) {
				c.t.Errorf("a log line shows the password %q:\n%s", secret, line)
			}
		}
		for _, e := range errs {
			if strings.Contains(e, secret) {
				c.t.Errorf("an error shows the password %q:\n%s", secret, e)
			}
		}
	}
	if c.t.Failed() || testing.Verbose() {
		c.t.Logf("errors checked:\n%s\nlogs checked:\n%s", strings.Join(errs, "\n"), logs)
	}
}

// newSecret returns a password that shows up nowhere by chance.
func newSecret(t *testing.T) string { return "pw-" + randomHex(t, 8) + "-secret" }

// closedAddr returns an address on 127.0.0.1 where nothing listens.
func closedAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	return addr
}

// passwordPool opens a pool on url, whose password must be secret.
func passwordPool(t *testing.T, url, secret string) *pgxpool.Pool {
	t.Helper()
	pool := pgtest.OpenPool(t, url)
	if pw := pool.Config().ConnConfig.Password; pw != secret {
		t.Fatalf("the pool's password is %q, want %q", pw, secret)
	}
	return pool
}

// passwordCluster starts a private cluster that, unlike the shared one,
// checks passwords: every role but the superuser logs in over 127.0.0.1
// with SCRAM. The superuser rewrites pg_hba.conf (COPY to a server file)
// and reloads it.
func passwordCluster(t *testing.T) *pgtest.Cluster {
	t.Helper()
	c := pgtest.NewCluster(t)
	admin := c.Admin(t)
	var superuser, hbaFile string
	if err := admin.QueryRow(callCtx(t), "SELECT current_user, current_setting('hba_file')").Scan(&superuser, &hbaFile); err != nil {
		t.Fatal(err)
	}
	hba := []string{
		"local all all trust",
		"host all " + superuser + " 127.0.0.1/32 trust",
		"host all all 127.0.0.1/32 scram-sha-256",
	}
	var rows []string
	for i, line := range hba {
		rows = append(rows, fmt.Sprintf("(%d, '%s')", i, line))
	}
	c.Exec(t, "COPY (SELECT line FROM (VALUES "+strings.Join(rows, ", ")+") AS v(n, line) ORDER BY n) TO '"+
		strings.ReplaceAll(hbaFile, "'", "''")+"'")
	c.Exec(t, "SELECT pg_reload_conf()")
	var hbaErrors string
	if err := admin.QueryRow(callCtx(t), "SELECT coalesce(string_agg(error, '; '), '') FROM pg_hba_file_rules").Scan(&hbaErrors); err != nil || hbaErrors != "" {
		t.Fatalf("pg_hba.conf: %q, %v", hbaErrors, err)
	}
	// The postmaster reloads in the background: wait until a wrong
	// password is refused.
	probe := "leader_probe_" + randomHex(t, 4)
	c.Exec(t, "CREATE ROLE "+probe+" LOGIN PASSWORD '"+randomHex(t, 8)+"'")
	probeURL, err := withLogin(c.NewDatabase(t), probe, "wrong")
	if err != nil {
		t.Fatal(err)
	}
	electortest.Eventually(t, 20*time.Second, "the server to check passwords", func() bool {
		conn, err := pgx.Connect(callCtx(t), probeURL)
		if err == nil {
			closeConn(conn)
			return false
		}
		var pgErr *pgconn.PgError
		return errors.As(err, &pgErr) && pgErr.Code == "28P01" // invalid_password
	})
	return c
}

// createRole creates a login role with password on the cluster of
// superURL (a superuser's connection string) and returns its name and a
// connection string for it on the same database.
func createRole(t *testing.T, c *pgtest.Cluster, superURL, password string) (name, url string) {
	t.Helper()
	name = "leader_app_" + randomHex(t, 4)
	c.Exec(t, "CREATE ROLE "+name+" LOGIN PASSWORD '"+password+"' NOSUPERUSER NOCREATEDB NOCREATEROLE")
	url, err := withLogin(superURL, name, password)
	if err != nil {
		t.Fatal(err)
	}
	return name, url
}

// runElector runs an Elector on store with debug logging into c. While
// the server cannot be reached (permanent false) it runs until it has
// logged "acquire failed" n times, about a second with its 100ms retries.
// When the server refuses with a permanent error, Run must return it, at
// once, and c records it.
func runElector(t *testing.T, c *leakCheck, store leader.Store, n int, permanent bool) {
	t.Helper()
	e, err := leader.New(store, leader.Config{Name: "secret", ID: "elector", TTL: time.Second, RetryInterval: 100 * time.Millisecond,
		Logger: c.logger("elector")})
	if err != nil {
		t.Fatal(err)
	}
	if permanent {
		ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
		defer cancel()
		start := time.Now()
		err := e.Run(ctx)
		took := time.Since(start)
		t.Logf("Elector.Run returned after %v", took.Round(time.Millisecond))
		if took > 5*time.Second { // a generous bound: it takes milliseconds
			t.Errorf("Elector.Run returned after %v; want it at once", took)
		}
		c.failed("Elector.Run", err)
		if !errors.Is(err, leader.ErrPermanent) {
			t.Errorf("Elector.Run: %v; want an error wrapping leader.ErrPermanent", err)
		}
		return
	}
	stop := electortest.Run(t, e)
	c.waitLogged("acquire failed", n)
	stop()
}

// serveRouter runs r.Serve under an Elector on a MemStore, which leads at
// once, until stop is called; Serve's error, if any, is recorded in c and
// sent on the channel.
func serveRouter(t *testing.T, c *leakCheck, r *Router) (served <-chan error, stop func()) {
	t.Helper()
	done := make(chan error, 1)
	e, err := leader.New(leadertest.NewMemStore(), leader.Config{Name: "router", ID: "router", Logger: c.logger("router-elector"),
		OnElected: func(ctx context.Context) {
			err := r.Serve(ctx)
			if err != nil {
				c.failed("Router.Serve", err)
			}
			done <- err
		}})
	if err != nil {
		t.Fatal(err)
	}
	return done, electortest.Run(t, e)
}

// cannotConnect makes every call of the stores, the Router and Migrate
// fail on pool, which cannot connect, and runs an Elector and a Router's
// Serve for a while, all logging into c. permanent says whether the server
// refuses the connection for good (a wrong password), which an Elector's
// Run returns.
func cannotConnect(t *testing.T, c *leakCheck, pool *pgxpool.Pool, permanent bool) {
	t.Helper()
	c.failed("Migrate", Migrate(callCtx(t), pool, Options{Logger: c.logger("migrate")}))

	store, err := NewLeaseStore(pool, Options{Logger: c.logger("lease store")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(store.Close)
	alice := candidate("alice")
	_, _, err = store.Acquire(callCtx(t), "secret", alice, time.Minute)
	c.failed("LeaseStore.Acquire", err)
	_, err = store.Renew(callCtx(t), "secret", alice.Token, 1, time.Minute)
	c.failed("LeaseStore.Renew", err)
	c.failed("LeaseStore.Release", store.Release(callCtx(t), "secret", alice.Token, 1))
	_, err = store.Observe(callCtx(t), "secret")
	c.failed("LeaseStore.Observe", err)
	if _, err := store.Watch(t.Context(), "secret"); err != nil {
		t.Fatal(err)
	}
	c.waitLogged("wake-up listener lost", 2)

	_, err = NewAdvisoryStore(callCtx(t), pool, Options{Logger: c.logger("advisory store")})
	c.failed("NewAdvisoryStore", err)

	r, err := NewRouter(pool, Options{Logger: c.logger("router")})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Handle("jobs", func(context.Context, Message) error { return nil }); err != nil {
		t.Fatal(err)
	}
	c.failed("Router.Notify", r.Notify(callCtx(t), "jobs", "payload"))
	c.failed("Router.NotifyDurable", r.NotifyDurable(callCtx(t), "jobs", "payload"))
	_, stopServing := serveRouter(t, c, r)
	c.waitLogged("router connection lost", 3)
	stopServing()

	runElector(t, c, store, 10, permanent)
}

func TestPasswordsNeverShow(t *testing.T) {
	t.Parallel()

	t.Run("when the server cannot be reached", func(t *testing.T) {
		t.Parallel()
		secret := newSecret(t)
		c := newLeakCheck(t, secret)
		url := "postgres://leader_app:" + secret + "@" + closedAddr(t) + "/leader?sslmode=disable&connect_timeout=2"
		cannotConnect(t, c, passwordPool(t, url, secret), false)
	})

	// The shared cluster trusts every connection (see newAppRole); this
	// one checks the passwords of every role but the superuser.
	cluster := passwordCluster(t)

	t.Run("when the server refuses the password", func(t *testing.T) {
		t.Parallel()
		secret, wrong := newSecret(t), newSecret(t)
		c := newLeakCheck(t, secret, wrong)
		superURL := cluster.NewDatabase(t)
		if err := Migrate(callCtx(t), pgtest.OpenPool(t, superURL), Options{}); err != nil {
			t.Fatal(err)
		}
		name, _ := createRole(t, cluster, superURL, secret)
		url, err := withLogin(superURL, name, wrong)
		if err != nil {
			t.Fatal(err)
		}
		pool := passwordPool(t, url, wrong)
		err = pool.Ping(callCtx(t))
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "28P01" {
			t.Fatalf("connecting with a wrong password: %v; want SQLSTATE 28P01 (invalid_password)", err)
		}
		cannotConnect(t, c, pool, true)
	})

	t.Run("when the tables do not exist", func(t *testing.T) {
		t.Parallel()
		secret := newSecret(t)
		c := newLeakCheck(t, secret)
		_, url := createRole(t, cluster, cluster.NewDatabase(t), secret)
		pool := passwordPool(t, url, secret)
		if err := pool.Ping(callCtx(t)); err != nil {
			t.Fatalf("the role cannot log in with its password: %v", err)
		}
		missingOrForbidden(t, c, pool, "42P01")
		// The role may not create tables in schema public (PostgreSQL 15
		// and later grant PUBLIC no CREATE on it).
		err := Migrate(callCtx(t), pool, Options{})
		c.failed("Migrate", err)
		if sqlState(err) != "42501" {
			t.Errorf("Migrate without CREATE on the schema: %v; want SQLSTATE 42501", err)
		}
	})

	t.Run("when the role lacks the privileges", func(t *testing.T) {
		t.Parallel()
		secret := newSecret(t)
		c := newLeakCheck(t, secret)
		superURL := cluster.NewDatabase(t)
		if err := Migrate(callCtx(t), pgtest.OpenPool(t, superURL), Options{}); err != nil {
			t.Fatal(err)
		}
		_, url := createRole(t, cluster, superURL, secret)
		missingOrForbidden(t, c, passwordPool(t, url, secret), "42501")
	})

	t.Run("through PgBouncer in transaction mode", func(t *testing.T) {
		t.Parallel()
		secret := newSecret(t)
		c := newLeakCheck(t, secret)
		superURL := cluster.NewDatabase(t)
		admin := pgtest.OpenPool(t, superURL)
		if err := Migrate(callCtx(t), admin, Options{}); err != nil {
			t.Fatal(err)
		}
		name, url := createRole(t, cluster, superURL, secret)
		for _, sql := range appGrants(name, admin.Config().ConnConfig.Database) {
			if _, err := admin.Exec(callCtx(t), sql); err != nil {
				t.Fatalf("%s: %v", sql, err)
			}
		}
		// PgBouncer logs in to the server with the role's password; its
		// clients need none (auth_type any), but this one gives it anyway,
		// as a program configured for a direct connection would.
		bouncer, err := withLogin(pgtest.PgBouncer(t, url, "transaction"), name, secret)
		if err != nil {
			t.Fatal(err)
		}
		pool := passwordPool(t, bouncer, secret)

		_, err = NewAdvisoryStore(callCtx(t), pool, Options{Logger: c.logger("advisory store")})
		c.failed("NewAdvisoryStore", err)
		if !errors.Is(err, ErrPooledSession) {
			t.Errorf("NewAdvisoryStore through PgBouncer: %v; want ErrPooledSession", err)
		}

		// The lease store works, and says in a warning that its wake-ups
		// cannot.
		store, err := NewLeaseStore(pool, Options{Logger: c.logger("lease store")})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(store.Close)
		if _, err := store.Watch(t.Context(), "secret"); err != nil {
			t.Fatal(err)
		}
		c.waitLogged("wake-ups are off", 1)

		r, err := NewRouter(pool, Options{Logger: c.logger("router")})
		if err != nil {
			t.Fatal(err)
		}
		if err := r.Handle("jobs", func(context.Context, Message) error { return nil }); err != nil {
			t.Fatal(err)
		}
		served, _ := serveRouter(t, c, r)
		select {
		case err := <-served:
			if !errors.Is(err, ErrPooledSession) {
				t.Errorf("Router.Serve through PgBouncer: %v; want ErrPooledSession", err)
			}
		case <-time.After(routerWait):
			t.Fatalf("Router.Serve through PgBouncer did not return within %v", routerWait)
		}
	})
}

// missingOrForbidden makes every call of the stores and the Router fail
// on pool, whose tables are missing or out of bounds (SQLSTATE code), runs
// an Elector and a Router's Serve on it, all logging into c.
func missingOrForbidden(t *testing.T, c *leakCheck, pool *pgxpool.Pool, code string) {
	t.Helper()
	failed := func(what string, err error) {
		t.Helper()
		c.failed(what, err)
		if sqlState(err) != code {
			t.Errorf("%s: %v; want SQLSTATE %s", what, err, code)
		}
	}
	store, err := NewLeaseStore(pool, Options{Logger: c.logger("lease store")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(store.Close)
	alice := candidate("alice")
	_, _, err = store.Acquire(callCtx(t), "secret", alice, time.Minute)
	failed("LeaseStore.Acquire", err)
	_, err = store.Renew(callCtx(t), "secret", alice.Token, 1, time.Minute)
	failed("LeaseStore.Renew", err)
	failed("LeaseStore.Release", store.Release(callCtx(t), "secret", alice.Token, 1))
	_, err = store.Observe(callCtx(t), "secret")
	failed("LeaseStore.Observe", err)

	_, err = NewAdvisoryStore(callCtx(t), pool, Options{Logger: c.logger("advisory store")})
	failed("NewAdvisoryStore", err)

	r, err := NewRouter(pool, Options{Logger: c.logger("router")})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Handle("jobs", func(context.Context, Message) error { return nil }); err != nil {
		t.Fatal(err)
	}
	failed("Router.NotifyDurable", r.NotifyDurable(callCtx(t), "jobs", "payload"))
	tx, err := pool.Begin(callCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	failed("Router.NotifyDurableTx", r.NotifyDurableTx(callCtx(t), tx, "jobs", "payload"))
	if err := tx.Rollback(callCtx(t)); err != nil {
		t.Fatal(err)
	}
	served, stopServing := serveRouter(t, c, r)
	if code == "42P01" {
		// Without its table Serve gives up.
		select {
		case err := <-served:
			if err == nil {
				t.Error("Router.Serve without its table returned nil")
			}
		case <-time.After(routerWait):
			t.Fatalf("Router.Serve without its table did not return within %v", routerWait)
		}
	} else {
		// Without privileges it logs each failed read and goes on.
		c.waitLogged("router could not read durable messages", 2)
	}
	stopServing()

	runElector(t, c, store, 10, true)
}

// TestPasswordsNeverShowWhenTheServerStops runs the stores, the Router and
// Electors as a role that logs in with a checked password, then stops the
// server under them, and checks that nothing they log or return shows the
// password.
func TestPasswordsNeverShowWhenTheServerStops(t *testing.T) {
	t.Parallel()
	cluster := passwordCluster(t)
	secret := newSecret(t)
	c := newLeakCheck(t, secret)
	superURL := cluster.NewDatabase(t)
	admin := pgtest.OpenPool(t, superURL)
	if err := Migrate(callCtx(t), admin, Options{}); err != nil {
		t.Fatal(err)
	}
	name, url := createRole(t, cluster, superURL, secret)
	for _, sql := range appGrants(name, admin.Config().ConnConfig.Database) {
		if _, err := admin.Exec(callCtx(t), sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	pool := passwordPool(t, url, secret)

	lease, err := NewLeaseStore(pool, Options{Logger: c.logger("lease store")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(lease.Close)
	advisory, err := NewAdvisoryStore(callCtx(t), pool, Options{Logger: c.logger("advisory store")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(advisory.Close)
	r, err := NewRouter(pool, Options{Logger: c.logger("router")})
	if err != nil {
		t.Fatal(err)
	}
	listening := make(chan struct{}, 1)
	r.onListen = func(uint32) {
		select {
		case listening <- struct{}{}:
		default:
		}
	}
	if err := r.Handle("jobs", func(context.Context, Message) error { return nil }); err != nil {
		t.Fatal(err)
	}

	// A leader and a follower on each strategy; the lease strategy's
	// leader serves the Router.
	var es []*leader.Elector
	for _, s := range []struct {
		name  string
		store leader.Store
	}{{"lease", lease}, {"advisory", advisory}} {
		for _, id := range []string{"a", "b"} {
			cfg := leader.Config{Name: s.name, ID: id, TTL: 2 * time.Second, RetryInterval: 100 * time.Millisecond,
				Logger: c.logger(s.name + "-" + id)}
			if s.name == "lease" {
				cfg.OnElected = func(ctx context.Context) {
					if err := r.Serve(ctx); err != nil {
						c.failed("Router.Serve", err)
					}
				}
			}
			e, err := leader.New(s.store, cfg)
			if err != nil {
				t.Fatal(err)
			}
			es = append(es, e)
			electortest.Run(t, e)
		}
	}
	electortest.Eventually(t, 20*time.Second, "a leader on each strategy", func() bool { return len(electortest.Leaders(es)) == 2 })
	select {
	case <-listening:
	case <-time.After(routerWait):
		t.Fatalf("Router.Serve did not LISTEN within %v", routerWait)
	}
	// Both strategies' followers watch: the lease store's listener and the
	// advisory store's lock waiter are up.

	cluster.Stop(t)
	for _, said := range []string{
		"wake-up listener lost",
		"lock waiter lost",
		"router connection lost",
		"stepped down",
		"acquire failed",
	} {
		c.waitLogged(said, 1)
	}
	_, err = advisory.Observe(callCtx(t), "advisory")
	c.failed("AdvisoryStore.Observe", err)
	_, _, err = advisory.Acquire(callCtx(t), "advisory", candidate("late"), time.Second)
	c.failed("AdvisoryStore.Acquire", err)
	_, _, err = lease.Acquire(callCtx(t), "lease", candidate("late"), time.Second)
	c.failed("LeaseStore.Acquire", err)
	c.failed("Router.Notify", r.Notify(callCtx(t), "jobs", "payload"))
}
