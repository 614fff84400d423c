package postgres

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader/internal/pgtest"
)

// wantPlannedAhead checks that conn's session has plan_cache_mode
// force_generic_plan, and, on PostgreSQL 14 and later (whose
// pg_prepared_statements counts plans), that each of stmts is prepared on
// it and was planned before it ran.
func wantPlannedAhead(t *testing.T, conn *pgx.Conn, stmts map[string]string) {
	t.Helper()
	var mode string
	var version int
	if err := conn.QueryRow(callCtx(t), `SELECT current_setting('plan_cache_mode'), current_setting('server_version_num')::int`,
		pgx.QueryExecModeSimpleProtocol).Scan(&mode, &version); err != nil {
		t.Fatal(err)
	}
	if mode != "force_generic_plan" {
		t.Fatalf("plan_cache_mode = %q; want force_generic_plan", mode)
	}
	// The warm-up ran: the release's own setting exists only once set.
	var named *string
	if err := conn.QueryRow(callCtx(t), `SELECT current_setting('`+namedChannelSetting+`', true)`,
		pgx.QueryExecModeSimpleProtocol).Scan(&named); err != nil {
		t.Fatal(err)
	}
	if named == nil || *named != "" {
		t.Fatalf("%s = %v after the warm-up; want it set, empty", namedChannelSetting, named)
	}
	if version < 140000 {
		return
	}
	for what, sql := range stmts {
		var plans int64
		err := conn.QueryRow(callCtx(t), `SELECT generic_plans FROM pg_prepared_statements WHERE statement = $1`,
			pgx.QueryExecModeSimpleProtocol, sql).Scan(&plans)
		if err != nil {
			t.Fatalf("the %s statement: %v", what, err)
		}
		if plans < 1 {
			t.Fatalf("the %s statement was not planned ahead (generic_plans %d)", what, plans)
		}
	}
}

// TestStoreConnectionsPlanAhead checks that a new connection of the
// lease store's own is readied for the store's statements (see
// planAhead): generic plans for the session, and the acquire, release and
// released lease's grant statements prepared and planned before their
// first run; and that
// nothing is set under the simple protocol.
func TestStoreConnectionsPlanAhead(t *testing.T) {
	t.Parallel()
	b := setup(t)
	conn, err := b.store.pool.Acquire(callCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	wantPlannedAhead(t, conn.Conn(), map[string]string{"acquire": b.store.sql.acquire, "release": b.store.sql.release,
		"grant of a released lease": b.store.sql.grantReleased})

	simple := poolWith(t, b.pool, func(c *pgx.ConnConfig) { c.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol })
	s := setupOn(t, simple, Options{}).store
	mustGrant(t, s, "simple", candidate("alice"), time.Minute)
	sconn, err := s.pool.Acquire(callCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer sconn.Release()
	var mode string
	if err := sconn.QueryRow(callCtx(t), `SELECT current_setting('plan_cache_mode')`).Scan(&mode); err != nil {
		t.Fatal(err)
	}
	if mode == "force_generic_plan" {
		t.Fatal("plan_cache_mode was set under the simple protocol")
	}

	// A pool whose hooks may reset its sessions: nothing is prepared
	// ahead on the store's own connections, which copy them.
	config := b.pool.Config()
	config.AfterRelease = func(*pgx.Conn) bool { return true }
	hooked, err := pgxpool.NewWithConfig(callCtx(t), config)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(hooked.Close)
	hs := setupOn(t, hooked, Options{}).store
	hconn, err := hs.pool.Acquire(callCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer hconn.Release()
	var prepared int
	if err := hconn.QueryRow(callCtx(t), `SELECT current_setting('plan_cache_mode'), (SELECT count(*) FROM pg_prepared_statements)`,
		pgx.QueryExecModeSimpleProtocol).Scan(&mode, &prepared); err != nil {
		t.Fatal(err)
	}
	if mode == "force_generic_plan" || prepared != 0 {
		t.Fatalf("on a pool with an AfterRelease hook, plan_cache_mode = %q and %d statements prepared ahead; want neither", mode, prepared)
	}
}

// TestAdvisorySessionsPlanAhead checks that the advisory strategy's
// candidate sessions and lock waiters are readied for their statements
// (see planAhead) as they are opened.
func TestAdvisorySessionsPlanAhead(t *testing.T) {
	t.Parallel()
	s := setupAdvisory(t, pgtest.NewPool(t), Options{})
	conn, err := s.connect(callCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer closeConn(conn)
	wantPlannedAhead(t, conn, map[string]string{"grantQuick": s.sql.grantQuick, "grant": s.sql.grant,
		"grantLocked": s.sql.grantLocked, "release": s.sql.release, "unlock": s.sql.unlock,
		"namedUnlock": s.sql.namedUnlock, "namedMark": s.sql.namedMark, "unlockRest": s.sql.unlockRest,
		"unlockHandedOver": s.sql.unlockHandedOver, "releaseHandedOver": s.sql.releaseHandedOver, "dropHolder": s.sql.dropHolder,
		"releaseGranting": s.sql.releaseGranting, "releaseGrantingStaged": s.sql.releaseGrantingStaged, "stagedUnlock": stagedUnlock})

	waiter, err := s.connectWaiter(callCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer closeConn(waiter)
	wantPlannedAhead(t, waiter, map[string]string{"waiter": s.sql.waiter, "reserved": s.sql.reserved})
}
