package postgres

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/internal/pgtest"
)

func TestMigrateIsIdempotent(t *testing.T) {
	t.Parallel()
	b := setup(t) // migrated once
	alice := candidate("alice")
	l := mustGrant(t, b.store, "kept", alice, time.Minute)
	for range 2 {
		if err := Migrate(callCtx(t), b.pool, Options{}); err != nil {
			t.Fatalf("Migrate again: %v", err)
		}
	}
	o, err := b.store.Observe(callCtx(t), "kept")
	if err != nil || o.HolderID != "alice" || o.Term != l.Term {
		t.Fatalf("lease after migrating again: %+v, %v", o, err)
	}
}

func TestMigrateConcurrently(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	opts := Options{Schema: "fresh_schema"} // created by the migrations racing here
	const migrators = 8
	errs := make([]error, migrators)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range migrators {
		wg.Go(func() {
			<-start
			errs[i] = Migrate(callCtx(t), pool, opts)
		})
	}
	close(start)
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("migrator %d: %v", i, err)
		}
	}
	s, err := NewLeaseStore(pool, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	mustGrant(t, s, "n", candidate("a"), time.Minute)
}

func TestMigrateQuotesOddSchemaAndTableNames(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	opts := Options{
		Schema: `Leader "Odd"; DROP SCHEMA public; --`,
		Table:  `leases.v2 "x"'y`,
	}
	b := setupOn(t, pool, opts) // migrates
	if err := Migrate(callCtx(t), pool, opts); err != nil {
		t.Fatalf("Migrate again: %v", err)
	}
	var found, publicExists bool
	err := pool.QueryRow(callCtx(t), `SELECT
		EXISTS (SELECT FROM pg_tables WHERE schemaname = $1 AND tablename = $2),
		EXISTS (SELECT FROM pg_namespace WHERE nspname = 'public')`, opts.Schema, opts.Table).Scan(&found, &publicExists)
	if err != nil {
		t.Fatal(err)
	}
	if !found || !publicExists {
		t.Fatalf("table found %v, public schema still there %v", found, publicExists)
	}
	if got := b.store.Options().Channel; got != opts.Schema+"."+opts.Table {
		t.Fatalf("default channel %q", got)
	}

	// The store works on that table, wake-ups included.
	s := b.store
	alice := candidate("alice")
	ch, err := s.Watch(t.Context(), "n")
	if err != nil {
		t.Fatal(err)
	}
	waitListening(t, b)
	drain(ch)
	l := mustGrant(t, s, "n", alice, time.Minute)
	waitWake(t, ch, "after a grant")
	if _, err := s.Renew(callCtx(t), "n", alice.Token, l.Term, time.Minute); err != nil {
		t.Fatal(err)
	}
	drain(ch)
	mustRelease(t, s, "n", alice, l.Term)
	waitWake(t, ch, "after a release")
	if o, err := s.Observe(callCtx(t), "n"); err != nil || o.Term != l.Term || o.Held() {
		t.Fatalf("Observe after release: %+v, %v", o, err)
	}
}

// TestLeaseTableLeavesRoomForRenewals checks that the lease table is
// created with fillfactor 50, so that renewals are heap-only updates, and
// that they are: a round of renewals of many leases writes no index entry.
// It runs on a private cluster: see TestHandoverTablesAreVacuumedRarely.
func TestLeaseTableLeavesRoomForRenewals(t *testing.T) {
	t.Parallel()
	b := setupOn(t, pgtest.NewCluster(t).NewPool(t), Options{})
	var opts []string
	if err := b.pool.QueryRow(callCtx(t), `SELECT coalesce(reloptions, '{}') FROM pg_class WHERE oid = 'public.leader_leases'::regclass`).Scan(&opts); err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(opts, "fillfactor=50") {
		t.Fatalf("lease table options %v; want fillfactor=50", opts)
	}
	const names = 500
	type held struct {
		name string
		c    leader.Candidate
		term uint64
	}
	var hs []held
	for i := range names {
		c := candidate("alice")
		name := fmt.Sprint("room-", i)
		hs = append(hs, held{name, c, mustGrant(t, b.store, name, c, time.Minute).Term})
	}
	stats := func() (upd, hot int64) {
		// The statistics collector reports a backend's counts when its
		// transaction ends; pg_stat_force_next_flush makes it now.
		if _, err := b.pool.Exec(callCtx(t), "SELECT pg_stat_force_next_flush()"); err != nil {
			t.Logf("pg_stat_force_next_flush: %v (older server)", err)
		}
		if err := b.pool.QueryRow(callCtx(t), `SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relid = 'public.leader_leases'::regclass`).Scan(&upd, &hot); err != nil {
			t.Fatal(err)
		}
		return upd, hot
	}
	for range 3 { // rounds of renewals, as a process holding every name sends
		var wg sync.WaitGroup
		for _, h := range hs {
			wg.Go(func() { mustRenew(t, b.store, h.name, h.c, h.term, time.Minute) })
		}
		wg.Wait()
	}
	electortest.Eventually(t, 10*time.Second, "the renewals to show in pg_stat_user_tables", func() bool {
		upd, _ := stats()
		return upd >= 3*names
	})
	// Nearly all are (1499 of 1500 measured on the private cluster; 1005
	// on the shared one while the package's other tests ran). The bound
	// is lower than that, for a page that a concurrent renewal keeps
	// pinned is not pruned then. At the default fillfactor, 13 were.
	upd, hot := stats()
	if hot < upd/2 {
		t.Errorf("%d of %d updates of the lease table were heap-only; want at least half", hot, upd)
	}
	t.Logf("%d of %d updates heap-only", hot, upd)
}

// A lease table made by an earlier version, without heartbeats, gets them
// when Migrate runs again, and its leases carry on: a lease granted before
// the upgrade is renewed in rounds after it.
func TestMigrateAddsHeartbeatsToAnEarlierLeaseTable(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	if _, err := pool.Exec(callCtx(t), `CREATE TABLE public.leader_leases (
		name text PRIMARY KEY, term bigint NOT NULL CHECK (term > 0), holder_token text,
		holder_id text NOT NULL DEFAULT '', acquired_at timestamptz, renewed_at timestamptz, expires_at timestamptz,
		CHECK ((holder_token IS NULL) = (expires_at IS NULL)))`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(callCtx(t), `INSERT INTO public.leader_leases VALUES
		('before', 4, 'token-a', 'alice', clock_timestamp(), clock_timestamp(), clock_timestamp() + interval '1 minute')`); err != nil {
		t.Fatal(err)
	}
	b := setupOn(t, pool, Options{})
	var indexed bool
	if err := pool.QueryRow(callCtx(t), `SELECT EXISTS (SELECT FROM pg_indexes
		WHERE tablename = 'leader_leases' AND indexdef LIKE '%(heartbeat)%')`).Scan(&indexed); err != nil || !indexed {
		t.Fatalf("heartbeat index after Migrate: %v, %v", indexed, err)
	}
	batch := []leader.Renewal{{Name: "before", Token: "token-a", Term: 4, TTL: time.Minute}}
	mustRenewBatch(t, b.store, batch)
	if got := heartbeatOf(t, pool, "before"); got == "" {
		t.Fatal("no heartbeat")
	}
	mustRenewBatch(t, b.store, []leader.Renewal{{Name: "before", Token: "token-a", Term: 4, TTL: time.Minute}})
	if l, err := b.store.Observe(callCtx(t), "before"); err != nil || !l.Held() || l.HolderID != "alice" || l.Term != 4 {
		t.Fatalf("Observe after the upgrade: %+v, %v; want alice holding term 4", l, err)
	}
}

// TestMigrateLeavesAnUpToDateSchemaAlone checks that Migrate on a schema
// that it made already takes no lock on the tables: its DDL would wait for
// (and could deadlock with) the stores' statements and status reads. A
// transaction holding the lease table in ACCESS SHARE mode, as every read
// does, must not hold it up.
func TestMigrateLeavesAnUpToDateSchemaAlone(t *testing.T) {
	t.Parallel()
	b := setup(t) // migrated once
	tx, err := b.pool.Begin(callCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(callCtx(t))
	if _, err := tx.Exec(callCtx(t), "LOCK TABLE "+b.store.opts.qualifiedTable()+" IN ACCESS SHARE MODE"); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	if err := Migrate(ctx, b.pool, Options{}); err != nil {
		t.Fatalf("Migrate of an up-to-date schema while a reader holds the lease table: %v", err)
	}
	// A schema whose mark is missing (made by an older version) is
	// migrated again, and marked.
	if err := tx.Rollback(callCtx(t)); err != nil {
		t.Fatal(err)
	}
	if _, err := b.pool.Exec(callCtx(t), "COMMENT ON TABLE "+b.store.opts.qualifiedTable()+" IS NULL"); err != nil {
		t.Fatal(err)
	}
	if err := Migrate(callCtx(t), b.pool, Options{}); err != nil {
		t.Fatalf("Migrate of an unmarked schema: %v", err)
	}
	var mark *string
	if err := b.pool.QueryRow(callCtx(t), "SELECT obj_description(to_regclass($1), 'pg_class')", b.store.opts.qualifiedTable()).Scan(&mark); err != nil {
		t.Fatal(err)
	}
	if mark == nil || !strings.HasPrefix(*mark, "leader schema ") {
		t.Fatalf("the lease table's comment after Migrate = %v; want the schema's mark", mark)
	}
}

// TestHandoverTablesAreVacuumedRarely checks that Migrate raises the
// autovacuum thresholds of the advisory strategy's table and the
// candidates' table, and gives them fillfactor 50 (migration 011), and
// that the updates which the raise relies on are heap-only, on tables of
// many rows: the grants and releases of many names, and candidates
// enlisted again, write no index entry, so their dead versions are pruned
// without VACUUM.
//
// It runs on a private cluster. A page is pruned only of the versions
// that no transaction on the server may still see, and a transaction
// that holds a transaction ID in any database, such as another test's,
// holds back the pruning of every database: on the shared cluster, one
// such transaction left open beside this test made 327 of the 600
// candidates' updates heap-only rather than all of them (seen in CI).
func TestHandoverTablesAreVacuumedRarely(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewCluster(t).NewPool(t)
	s := setupAdvisory(t, pool, Options{})
	tables := []string{s.opts.qualifiedAdvisoryTable(), s.opts.qualifiedCandidateTable()}
	for _, table := range tables {
		var opts []string
		if err := pool.QueryRow(callCtx(t), `SELECT coalesce(reloptions, '{}') FROM pg_class WHERE oid = $1::regclass`, table).Scan(&opts); err != nil {
			t.Fatal(err)
		}
		for _, want := range []string{"autovacuum_vacuum_threshold=10000", "autovacuum_analyze_threshold=10000", "fillfactor=50"} {
			if !slices.Contains(opts, want) {
				t.Errorf("table %s options %v; want %s", table, opts, want)
			}
		}
	}

	// 40 names granted and released three times by one candidate (a
	// session each), and 300 candidates of one name enlisted three times.
	const names, candidates, rounds = 40, 300, 3
	alice := candidate("alice")
	var cs []leader.Candidate
	for i := range candidates {
		cs = append(cs, candidate(fmt.Sprint("c", i)))
	}
	for range rounds {
		for i := range names {
			name := fmt.Sprint("rarely-", i)
			mustRelease(t, s, name, alice, mustGrant(t, s, name, alice, time.Minute).Term)
		}
		for _, c := range cs {
			if err := s.Enlist(callCtx(t), "rarely", c, time.Minute); err != nil {
				t.Fatal(err)
			}
		}
	}
	// A backend reports its counts as its transaction ends, at most once
	// a second, and as it exits: close every connection that wrote.
	s.Close()
	pool.Reset()
	stats := func(table string) (upd, hot int64) {
		if err := pool.QueryRow(callCtx(t), `SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relid = $1::regclass`, table).Scan(&upd, &hot); err != nil {
			t.Fatal(err)
		}
		return upd, hot
	}
	wantUpdates := map[string]int64{tables[0]: names * (2*rounds - 1), tables[1]: candidates * (rounds - 1)}
	for _, table := range tables {
		electortest.Eventually(t, 20*time.Second, "the updates of "+table+" to show in pg_stat_user_tables", func() bool {
			upd, _ := stats(table)
			return upd >= wantUpdates[table]
		})
		upd, hot := stats(table)
		if hot < upd*3/4 {
			t.Errorf("%d of %d updates of %s were heap-only; want at least 3/4", hot, upd, table)
		}
		t.Logf("%s: %d of %d updates heap-only", table, hot, upd)
	}
}
