package postgres

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/pgtest"
)

// TestPermanentHints checks what each server error that retrying will not
// mend tells a person to do, and that other errors get no hint.
func TestPermanentHints(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		code, message string
		want          []string // in the hint; none: no hint
	}{
		{"28P01", `password authentication failed for user "app"`, []string{"authentication failed", "password"}},
		{"28000", `no pg_hba.conf entry for host "10.0.0.1"`, []string{"authentication failed", "pg_hba.conf"}},
		{"3D000", `database "nope" does not exist`, []string{"database does not exist", "create it"}},
		{"42P01", `relation "public.leader_leases" does not exist`, []string{"leader migrate", "postgres.Migrate"}},
		{"3F000", `schema "elections" does not exist`, []string{"leader migrate"}},
		{"42703", `column c.since does not exist`, []string{"older version", "leader migrate"}},
		{"42501", "permission denied for table leader_heartbeats", []string{"GRANT SELECT, INSERT, UPDATE ON leader_heartbeats", "DELETE", "Privileges"}},
		{"42501", "permission denied for table leader_leases_candidates", []string{"GRANT SELECT, INSERT, UPDATE ON leader_leases_candidates", "DELETE", "candidates'"}},
		{"42501", "permission denied for schema elections", []string{"GRANT USAGE ON SCHEMA elections"}},
		{"42501", "permission denied for database app", []string{"GRANT CONNECT ON DATABASE app"}},
		{"42501", "permission denied for function leader_leases_fence", []string{"GRANT EXECUTE ON FUNCTION leader_leases_fence", "FenceFunction"}},
		{"42501", "permission denied for sequence leader_messages_id_seq", []string{"Privileges"}},
		{"25006", "cannot execute UPDATE in a read-only transaction", nil},
		{"57P01", "terminating connection due to administrator command", nil},
		{"40001", "could not serialize access", nil},
	} {
		err := &pgconn.PgError{Code: c.code, Message: c.message}
		hint := permanentHint(err)
		if len(c.want) == 0 {
			if hint != "" {
				t.Errorf("%s: hint %q; want none (it is not permanent)", c.code, hint)
			}
			continue
		}
		for _, w := range c.want {
			if !strings.Contains(hint, w) {
				t.Errorf("%s %q: hint %q does not say %q", c.code, c.message, hint, w)
			}
		}
		wrapped := wrapError(context.Background(), `acquire "x"`, err)
		if !errors.Is(wrapped, leader.ErrPermanent) || errors.Is(wrapped, leader.ErrUnavailable) {
			t.Errorf("%s: wrapError = %v; want it to wrap leader.ErrPermanent only", c.code, wrapped)
		}
	}
}

// runUntilReturns runs an Elector on store until Run returns, and returns
// its error and how long Run took; it fails the test if Run runs on for
// 30 s.
func runUntilReturns(t *testing.T, store leader.Store, ttl time.Duration) (error, time.Duration) {
	t.Helper()
	e, err := leader.New(store, leader.Config{Name: "permanent", TTL: ttl, RetryInterval: ttl / 10,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	start := time.Now()
	err = e.Run(ctx)
	if ctx.Err() != nil {
		t.Fatalf("Run ran on for 30s; want it to return the store's permanent error")
	}
	return err, time.Since(start)
}

// TestRunReturnsPermanentErrorsOnARealServer checks, on a real server,
// that Run returns at once an unknown database's error, and an error
// wrapping both ErrPermanent and ErrReadOnly for a database read-only from
// the start, after a TTL. (Wrong passwords, missing tables and missing
// grants: TestPasswordsNeverShow.)
func TestRunReturnsPermanentErrorsOnARealServer(t *testing.T) {
	t.Parallel()

	t.Run("unknown database", func(t *testing.T) {
		t.Parallel()
		existing := pgtest.NewDatabase(t)
		cfg, err := pgx.ParseConfig(existing)
		if err != nil {
			t.Fatal(err)
		}
		url := strings.Replace(existing, "/"+cfg.Database, "/no_such_database_here", 1)
		s, err := NewLeaseStore(pgtest.OpenPool(t, url), Options{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(s.Close)
		err, took := runUntilReturns(t, s, 5*time.Second)
		if !errors.Is(err, leader.ErrPermanent) || !strings.Contains(err.Error(), "database does not exist") {
			t.Errorf("Run on an unknown database: %v; want the permanent error saying so", err)
		}
		if took > 5*time.Second {
			t.Errorf("Run took %v to return; want it at once", took)
		}
		t.Logf("Run returned after %v", took)
	})

	t.Run("a database read-only from the start", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		db := b.pool.Config().ConnConfig.Database
		pgtest.Shared(t).Exec(t, "ALTER DATABASE "+pgx.Identifier{db}.Sanitize()+" SET default_transaction_read_only = on")
		b.store.ResetConnections()
		const ttl = 2 * time.Second
		err, took := runUntilReturns(t, b.store, ttl)
		if !errors.Is(err, leader.ErrPermanent) || !errors.Is(err, leader.ErrReadOnly) {
			t.Errorf("Run on a read-only database: %v; want an error wrapping ErrPermanent and ErrReadOnly", err)
		}
		if took < ttl {
			t.Errorf("Run gave up after %v, before a TTL of refusals (%v)", took, ttl)
		}
	})
}
