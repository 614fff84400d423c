package postgres

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"os"
	"slices"
	"strings"
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

// appRole is a login role that holds only the privileges the stores and the
// Router need (appGrants), on a database that a superuser migrated.
type appRole struct {
	name string
	url  string        // the role's connection string, password included
	pool *pgxpool.Pool // as the role
	// admin is a superuser's pool on the same database.
	admin *pgxpool.Pool
	// logs holds what every store, Router and Elector of the role logged.
	logs *electortest.LogBuffer
}

// appGrants are the statements that give role what the stores and the
// Router need on the tables Migrate created with default Options in
// database, and nothing else. The identity sequence of the message table
// needs no grant: PostgreSQL does not check privileges on it when an
// INSERT fills the identity column.
func appGrants(role, database string) []string {
	r, db := pgx.Identifier{role}.Sanitize(), pgx.Identifier{database}.Sanitize()
	return []string{
		"GRANT CONNECT ON DATABASE " + db + " TO " + r,
		"GRANT USAGE ON SCHEMA public TO " + r,
		"GRANT SELECT, INSERT, UPDATE ON public.leader_leases, public.leader_advisory, public.leader_strategies TO " + r,
		"GRANT SELECT, INSERT ON public.leader_leases_epochs TO " + r,
		"GRANT SELECT, INSERT, UPDATE, DELETE ON public.leader_heartbeats TO " + r,
		"GRANT SELECT, INSERT, UPDATE, DELETE ON public.leader_leases_candidates TO " + r,
		"GRANT SELECT, INSERT, UPDATE, DELETE ON public.leader_messages TO " + r,
	}
}

// newAppRole migrates a fresh database as the superuser, takes from PUBLIC
// every privilege on the database and on schema public (PostgreSQL grants
// PUBLIC CONNECT and TEMPORARY on databases, and USAGE on schema public; 15
// and later no longer grant CREATE on it), and creates a login role with a
// random name and password that holds appGrants only. The role is dropped
// when t ends.
//
// The throwaway cluster trusts every connection from 127.0.0.1 (initdb -A
// trust, see internal/pgtest), so the role's password is sent nowhere and
// checked by no one here; that does not matter for privileges, which are
// the same however the role logged in. TestPasswordsNeverShow logs in with
// checked passwords.
func newAppRole(t *testing.T) appRole {
	t.Helper()
	superURL := pgtest.NewDatabase(t)
	admin := pgtest.OpenPool(t, superURL)
	if err := Migrate(callCtx(t), admin, Options{}); err != nil {
		t.Fatalf("Migrate as the superuser: %v", err)
	}
	name := "leader_app_" + randomHex(t, 4)
	password := "pw-" + randomHex(t, 8) + "-secret"
	role := pgx.Identifier{name}.Sanitize()
	exec := func(sql string) {
		t.Helper()
		if _, err := admin.Exec(callCtx(t), sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	exec("CREATE ROLE " + role + " LOGIN PASSWORD '" + password + "' NOSUPERUSER NOCREATEDB NOCREATEROLE")
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		// Its privileges first (DROP OWNED revokes them), then the role,
		// which lives beyond this database.
		if _, err := admin.Exec(ctx, "DROP OWNED BY "+role); err != nil {
			t.Errorf("DROP OWNED BY %s: %v", role, err)
			return
		}
		pgtest.Shared(t).Exec(t, "DROP ROLE "+role)
	})
	database := admin.Config().ConnConfig.Database
	exec("REVOKE ALL ON DATABASE " + pgx.Identifier{database}.Sanitize() + " FROM PUBLIC")
	exec("REVOKE ALL ON SCHEMA public FROM PUBLIC")
	for _, sql := range appGrants(name, database) {
		exec(sql)
	}
	appURL, err := withLogin(superURL, name, password)
	if err != nil {
		t.Fatal(err)
	}
	return appRole{name: name, url: appURL, pool: pgtest.OpenPool(t, appURL), admin: admin, logs: new(electortest.LogBuffer)}
}

// logger returns a logger that writes to r.logs (and to stderr when
// LEADER_TEST_LOG is set), at debug level.
func (r appRole) logger(instance string) *slog.Logger {
	var w io.Writer = r.logs
	if os.Getenv("LEADER_TEST_LOG") != "" {
		w = io.MultiWriter(r.logs, os.Stderr)
	}
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelDebug})).With("instance", instance)
}

// options returns default Options logging to r.logs as instance.
func (r appRole) options(instance string) Options {
	return Options{Logger: r.logger(instance)}
}

// newPool returns a pool of its own as the role, as a process of its own
// would have.
func (r appRole) newPool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	return pgtest.OpenPool(t, r.url)
}

// leaseStore returns a LeaseStore as the role on a pool of its own.
func (r appRole) leaseStore(t *testing.T, instance string) *LeaseStore {
	t.Helper()
	s, err := NewLeaseStore(r.newPool(t), r.options(instance))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

// advisoryStore returns an AdvisoryStore as the role on a pool of its own.
func (r appRole) advisoryStore(t *testing.T, instance string) *AdvisoryStore {
	t.Helper()
	s, err := NewAdvisoryStore(callCtx(t), r.newPool(t), r.options(instance))
	if err != nil {
		t.Fatalf("NewAdvisoryStore as %s: %v", r.name, err)
	}
	t.Cleanup(s.Close)
	return s
}

// withLogin returns connString with its user and password replaced.
func withLogin(connString, user, password string) (string, error) {
	if strings.HasPrefix(connString, "postgres://") || strings.HasPrefix(connString, "postgresql://") {
		u, err := url.Parse(connString)
		if err != nil {
			return "", fmt.Errorf("parsing the connection URL: %w", err)
		}
		u.User = url.UserPassword(user, password)
		return u.String(), nil
	}
	// Keyword/value form: a later keyword overrides an earlier one.
	quote := strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace
	return connString + " user='" + quote(user) + "' password='" + quote(password) + "'", nil
}

func randomHex(t testing.TB, n int) string {
	t.Helper()
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

// TestLeastPrivilege runs the stores and the Router as a role that may not
// create anything and holds only appGrants, on tables a superuser migrated.
func TestLeastPrivilege(t *testing.T) {
	t.Parallel()
	role := newAppRole(t)
	// A privilege missing for background work (a listener, a lock waiter,
	// the Router deleting a message) shows only in the logs.
	t.Cleanup(func() {
		if logs := role.logs.String(); strings.Contains(logs, "permission denied") || strings.Contains(logs, "SQLSTATE 42501") {
			t.Errorf("a store, Router or Elector running as %s was refused a privilege:\n%s", role.name, logs)
		}
	})

	t.Run("the role can create nothing and holds only the grants", func(t *testing.T) {
		t.Parallel()
		for _, sql := range []string{
			"CREATE TABLE public.intruder (i int)",
			"CREATE TEMPORARY TABLE intruder (i int)",
			"CREATE SCHEMA intruder",
			"CREATE INDEX intruder ON public.leader_leases (holder_id)",
			"ALTER TABLE public.leader_leases ADD COLUMN intruder int",
			"TRUNCATE public.leader_messages",
			"DELETE FROM public.leader_leases",
			"SELECT nextval(pg_get_serial_sequence('public.leader_messages', 'id'))",
		} {
			_, err := role.pool.Exec(callCtx(t), sql)
			// ALTER TABLE and CREATE INDEX need ownership: 42501 too.
			if code := sqlState(err); code != "42501" {
				t.Errorf("%s as %s: %v; want SQLSTATE 42501 (insufficient_privilege)", sql, role.name, err)
			}
		}

		var super, createDB, createRole, replication, bypassRLS, readAllStats, monitor bool
		err := role.pool.QueryRow(callCtx(t), `SELECT rolsuper, rolcreatedb, rolcreaterole, rolreplication, rolbypassrls,
				pg_has_role(current_user, 'pg_read_all_stats', 'MEMBER'), pg_has_role(current_user, 'pg_monitor', 'MEMBER')
			FROM pg_roles WHERE rolname = current_user`).
			Scan(&super, &createDB, &createRole, &replication, &bypassRLS, &readAllStats, &monitor)
		if err != nil {
			t.Fatal(err)
		}
		if super || createDB || createRole || replication || bypassRLS || readAllStats || monitor {
			t.Errorf("%s: superuser %v, createdb %v, createrole %v, replication %v, bypassrls %v, pg_read_all_stats %v, pg_monitor %v; want none",
				role.name, super, createDB, createRole, replication, bypassRLS, readAllStats, monitor)
		}

		// Exactly the grants, table by table; nothing on the message
		// table's identity sequence.
		rows, err := role.pool.Query(callCtx(t), `SELECT table_name || ' ' || string_agg(privilege_type, ',' ORDER BY privilege_type)
			FROM information_schema.table_privileges WHERE grantee = current_user GROUP BY table_name ORDER BY table_name`)
		if err != nil {
			t.Fatal(err)
		}
		got, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		want := []string{
			"leader_advisory INSERT,SELECT,UPDATE",
			"leader_heartbeats DELETE,INSERT,SELECT,UPDATE",
			"leader_leases INSERT,SELECT,UPDATE",
			"leader_leases_candidates DELETE,INSERT,SELECT,UPDATE",
			"leader_leases_epochs INSERT,SELECT",
			"leader_messages DELETE,INSERT,SELECT,UPDATE",
			"leader_strategies INSERT,SELECT,UPDATE",
		}
		if !slices.Equal(got, want) {
			t.Errorf("table privileges of %s: %q; want %q", role.name, got, want)
		}
		var onSequence bool
		err = role.pool.QueryRow(callCtx(t), `SELECT has_sequence_privilege(pg_get_serial_sequence('public.leader_messages', 'id'), 'USAGE')
			OR has_sequence_privilege(pg_get_serial_sequence('public.leader_messages', 'id'), 'UPDATE')`).Scan(&onSequence)
		if err != nil || onSequence {
			t.Errorf("%s has privileges on the message table's identity sequence (%v, %v); want none", role.name, onSequence, err)
		}
	})

	t.Run("Migrate as the role does nothing on an up-to-date schema, and fails for want of CREATE on one that needs a change", func(t *testing.T) {
		t.Parallel()
		// The schema is up to date: Migrate sees its mark and does
		// nothing, which needs no privilege.
		if err := Migrate(callCtx(t), role.pool, Options{}); err != nil {
			t.Fatalf("Migrate as %s of an up-to-date schema: %v; want nil (nothing to do)", role.name, err)
		}
		// Without the mark (a schema of an older version), it runs the
		// migrations. Every statement says IF NOT EXISTS, but PostgreSQL
		// checks the CREATE privilege on the schema before it looks for
		// the table, so it fails as the role even though every table
		// exists. Run it as the role that owns the tables; the stores
		// never need it (the other subtests).
		if _, err := role.admin.Exec(callCtx(t), "COMMENT ON TABLE public.leader_leases IS NULL"); err != nil {
			t.Fatal(err)
		}
		err := Migrate(callCtx(t), role.pool, Options{})
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
			t.Fatalf("Migrate as %s: %v; want an error wrapping a *pgconn.PgError with SQLSTATE 42501", role.name, err)
		}
		for _, want := range []string{"migrate", "permission denied for schema public"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("Migrate as %s: %q does not say %q", role.name, err, want)
			}
		}
		if errors.Is(err, leader.ErrUnavailable) || errors.Is(err, leader.ErrReadOnly) {
			t.Errorf("Migrate as %s: %v is classified as unavailable or read-only", role.name, err)
		}
		t.Logf("Migrate as %s: %v", role.name, err)
		// It changed nothing: the tables are the superuser's still.
		var owner string
		if err := role.pool.QueryRow(callCtx(t), "SELECT tableowner FROM pg_tables WHERE tablename = 'leader_leases'").Scan(&owner); err != nil || owner == role.name {
			t.Errorf("leader_leases owned by %q (%v)", owner, err)
		}
	})

	t.Run("the lease store passes the conformance suite", func(t *testing.T) {
		t.Parallel()
		leadertest.TestStore(t, func(t *testing.T) leader.Store {
			return role.leaseStore(t, "conformance")
		})
	})

	t.Run("the advisory store passes the conformance suite", func(t *testing.T) {
		t.Parallel()
		leadertest.TestStore(t, func(t *testing.T) leader.Store {
			return role.advisoryStore(t, "conformance")
		})
	})

	t.Run("a follower is told how long an idle advisory holder of the same role has left", func(t *testing.T) {
		t.Parallel()
		// pg_stat_activity shows a session's state and state_change only
		// to its own role (and members, and pg_read_all_stats, which the
		// role is not): enough when every candidate logs in as one role.
		holder, follower := role.advisoryStore(t, "holder"), role.advisoryStore(t, "follower")
		const ttl = 10 * time.Second
		alice, bob := candidate("alice"), candidate("bob")
		sent := time.Now()
		mustGrant(t, holder, "remaining", alice, ttl)
		idleFrom := time.Now() // the holder's session has been idle since before this
		var (
			l               leader.Lease
			asked, answered time.Time
		)
		for {
			asked = time.Now()
			var granted bool
			l, granted = mustAcquire(t, follower, "remaining", bob, ttl)
			answered = time.Now()
			if granted {
				t.Fatalf("the follower was granted a held lease: %+v", l)
			}
			if asked.Sub(idleFrom) >= time.Second { // time for the idle time to show
				break
			}
		}
		// The holder went idle between sent and idleFrom, but for the
		// grant's announcement, a statement of its own on the holder's
		// session a moment after the grant (allowed for by announced);
		// the server judged between asked and answered (one host, one
		// clock). Told the whole TTL instead, the follower would get
		// nearly 10s, over high.
		const slack, announced = 5 * time.Millisecond, 500 * time.Millisecond
		low, high := sent.Add(ttl).Sub(answered)-slack, idleFrom.Add(ttl).Sub(asked)+announced
		if l.HolderID != "alice" || l.Remaining < low || l.Remaining > high {
			t.Errorf("the follower was told %+v; want alice holding with Remaining in [%v, %v]", l, low, high)
		}
	})

	t.Run("a follower is told the whole TTL of an advisory holder of another role", func(t *testing.T) {
		t.Parallel()
		// The holder logs in as the superuser: its session's state is
		// hidden from the role, and the follower is told the whole TTL
		// (see observeRow). Safe, but no better than that.
		holder, err := NewAdvisoryStore(callCtx(t), role.admin, Options{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(holder.Close)
		follower := role.advisoryStore(t, "follower")
		const ttl = 10 * time.Second
		mustGrant(t, holder, "other-role", candidate("alice"), ttl)
		l, granted := mustAcquire(t, follower, "other-role", candidate("bob"), ttl)
		if granted || l.HolderID != "alice" || l.Remaining != ttl {
			t.Errorf("the follower was told %+v (granted %v); want alice holding with Remaining the whole %v", l, granted, ttl)
		}
	})

	t.Run("two electors on the lease strategy elect one leader and hand over", func(t *testing.T) {
		t.Parallel()
		electAndHandOver(t, role, "handover-lease", func(t *testing.T, instance string) leader.Store { return role.leaseStore(t, instance) })
	})

	t.Run("two electors on the advisory strategy elect one leader and hand over", func(t *testing.T) {
		t.Parallel()
		electAndHandOver(t, role, "handover-advisory", func(t *testing.T, instance string) leader.Store { return role.advisoryStore(t, instance) })
	})

	t.Run("the router delivers best-effort and durable messages", func(t *testing.T) {
		t.Parallel()
		routeAs(t, role)
	})

	t.Run("the role may fence its transactions, on both strategies", func(t *testing.T) {
		t.Parallel()
		// The fence function is executable by PUBLIC, and its row locks
		// need the UPDATE privilege that the role has.
		for _, s := range []leader.Store{role.leaseStore(t, "fence-lease"), role.advisoryStore(t, "fence-advisory")} {
			name := fmt.Sprintf("fence-%T", s)
			alice := candidate("alice")
			l := mustGrant(t, s, name, alice, time.Minute)
			fence := func(term uint64) error {
				return pgx.BeginFunc(callCtx(t), role.pool, func(tx pgx.Tx) error {
					return Fence(callCtx(t), tx, Options{}, name, term)
				})
			}
			if err := fence(l.Term); err != nil {
				t.Errorf("%s: Fence of the holder's term as %s: %v", name, role.name, err)
			}
			mustRelease(t, s, name, alice, l.Term)
			if err := fence(l.Term); !errors.Is(err, leader.ErrLeaseLost) {
				t.Errorf("%s: Fence of a released term as %s: %v; want leader.ErrLeaseLost", name, role.name, err)
			}
		}
	})
}

// electAndHandOver runs two Electors of name as role, each on a store of its own
// from newStore, checks that exactly one leads, stops it, and checks that
// the other takes over at once (woken by NOTIFY or the lock waiter, not at
// the TTL) with a greater term.
func electAndHandOver(t *testing.T, role appRole, name string, newStore func(t *testing.T, instance string) leader.Store) {
	const ttl = 15 * time.Second // a takeover that waited for it would show
	h := electortest.NewHistory()
	var es []*leader.Elector
	stops := map[*leader.Elector]func(){}
	for _, id := range []string{"a", "b"} {
		cfg := leader.Config{Name: name, ID: id, TTL: ttl, Logger: role.logger(id)}
		cfg.OnElected, cfg.OnDemoted = h.Hooks(t, id)
		e, err := leader.New(newStore(t, id), cfg)
		if err != nil {
			t.Fatal(err)
		}
		es = append(es, e)
		stops[e] = electortest.Run(t, e)
	}
	old := leaderOf(t, es, 15*time.Second)
	oldTerm := old.Status().Term
	electortest.Never(t, 300*time.Millisecond, "two leaders at once", func() bool { return len(electortest.Leaders(es)) > 1 })
	start := time.Now()
	stops[old]()
	rest := slices.DeleteFunc(slices.Clone(es), func(e *leader.Elector) bool { return e == old })
	next := leaderOf(t, rest, ttl)
	took := time.Since(start)
	t.Logf("as %s: handover after a graceful stop took %v (TTL %v)", role.name, took, ttl)
	if took > 5*time.Second {
		t.Errorf("handover took %v with a %v TTL: the follower was not woken", took, ttl)
	}
	if term := next.Status().Term; term <= oldTerm {
		t.Errorf("term went from %d to %d", oldTerm, term)
	}
	// Status shows the new leader before its OnElected has run.
	electortest.Eventually(t, 10*time.Second, "the new leader's OnElected to run", func() bool { return len(h.Elections()) >= 2 })
	electortest.Never(t, 100*time.Millisecond, "a third election", func() bool { return len(h.Elections()) > 2 })
}

// routeAs runs a Router as role under an Elector and checks that it
// delivers a best-effort message, and durable messages sent before and
// while it serves, one of them failing once: every statement the Router
// has (INSERT, SELECT, UPDATE of attempts, DELETE).
func routeAs(t *testing.T, role appRole) {
	store := role.leaseStore(t, "router")
	r, err := NewRouter(role.newPool(t), role.options("router"))
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
	box := newInbox()
	box.fail = func(m Message) error {
		if m.Payload == "fails once" && m.Attempts == 0 {
			return errors.New("the first delivery fails")
		}
		return nil
	}
	if err := r.Handle("jobs", box.handle); err != nil {
		t.Fatal(err)
	}
	// Sent while no one leads: they wait in the table.
	for _, p := range []string{"queued", "fails once"} {
		if err := r.NotifyDurable(callCtx(t), "jobs", p); err != nil {
			t.Fatalf("NotifyDurable as %s: %v", role.name, err)
		}
	}
	e, err := leader.New(store, leader.Config{
		Name:   "router",
		ID:     "router",
		TTL:    5 * time.Second,
		Logger: role.logger("router"),
		OnElected: func(ctx context.Context) {
			if err := r.Serve(ctx); err != nil {
				t.Errorf("Serve as %s: %v", role.name, err)
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	electortest.Run(t, e)
	select {
	case <-listening:
	case <-time.After(routerWait):
		t.Fatalf("Serve did not LISTEN within %v", routerWait)
	}
	if err := r.Notify(callCtx(t), "jobs", "best effort"); err != nil {
		t.Fatalf("Notify as %s: %v", role.name, err)
	}
	if err := r.NotifyDurable(callCtx(t), "jobs", "durable"); err != nil {
		t.Fatalf("NotifyDurable as %s: %v", role.name, err)
	}
	msgs := box.waitFor(t, 5)
	var durable []string
	for _, m := range msgs {
		if m.Durable {
			durable = append(durable, fmt.Sprintf("%s#%d", m.Payload, m.Attempts))
		}
	}
	if want := []string{"queued#0", "fails once#0", "fails once#1", "durable#0"}; !slices.Equal(durable, want) {
		t.Errorf("durable deliveries %q; want %q", durable, want)
	}
	if best := only(msgs, false); len(best) != 1 || best[0].Payload != "best effort" {
		t.Errorf("best-effort deliveries %q; want [best effort]", payloads(best))
	}
	// Each was deleted once handled.
	electortest.Eventually(t, routerWait, "the message table to empty", func() bool {
		var n int
		if err := role.pool.QueryRow(callCtx(t), "SELECT count(*) FROM leader_messages").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 0
	})
}

// TestHeartbeatsWithoutDelete checks a role that may not delete heartbeat
// rows (the grants of an earlier version): renewals go on as ever, and the
// store says once, with the GRANT to run, that it cannot delete the rows
// of processes long gone.
func TestHeartbeatsWithoutDelete(t *testing.T) {
	t.Parallel()
	role := newAppRole(t)
	if _, err := role.admin.Exec(callCtx(t), "REVOKE DELETE ON public.leader_heartbeats FROM "+pgx.Identifier{role.name}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	alice := candidate("alice")
	for i := range 2 { // two stores, two new heartbeats
		s := role.leaseStore(t, fmt.Sprint("store-", i))
		l := mustGrant(t, s, fmt.Sprint("no-delete-", i), alice, time.Minute)
		for range 3 {
			mustRenewBatch(t, s, renewals(alice, time.Minute, l))
		}
	}
	if n := strings.Count(role.logs.String(), "GRANT DELETE ON \\\"public\\\".\\\"leader_heartbeats\\\""); n != 2 {
		t.Errorf("%d warnings naming the GRANT DELETE; want one per store:\n%s", n, role.logs.String())
	}
}
