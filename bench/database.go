package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader/bench/internal/pglock"
	"github.com/leaderelect/leader/bench/internal/skill"
	"github.com/leaderelect/leader/internal/pgtest"
	"github.com/leaderelect/leader/postgres"
)

// serverSettings are the bench cluster's settings beyond pgtest's: statement
// statistics per role and database, and room for the idle-cost
// measurement of the advisory strategy, which opens a connection per
// candidate.
var serverSettings = []string{
	"shared_preload_libraries = 'pg_stat_statements'",
	"pg_stat_statements.track = top",
	"pg_stat_statements.track_utility = on",
	"max_connections = 1500",
}

// database is the PostgreSQL server of a run: a throwaway cluster, or the
// one named by -database-url.
type database struct {
	cluster  *pgtest.Standalone // nil for -database-url
	adminURL *url.URL           // superuser on the maintenance database
	admin    *pgxpool.Pool
	// statements: pg_stat_statements can be read (the cluster preloads
	// it; a given server may not).
	statements bool
	password   string // of the benchmark's roles
}

func openDatabase(ctx context.Context, databaseURL string) (*database, error) {
	d := &database{}
	if databaseURL == "" {
		c, err := pgtest.StartStandalone(pgtest.StandaloneOptions{Settings: serverSettings})
		if err != nil {
			return nil, err
		}
		d.cluster = c
		databaseURL = c.ConnString("postgres")
	}
	u, err := url.Parse(databaseURL)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		d.close()
		return nil, fmt.Errorf("-database-url must be a postgres:// URL: %q", databaseURL)
	}
	d.adminURL = u
	if d.admin, err = pgxpool.New(ctx, databaseURL); err != nil {
		d.close()
		return nil, err
	}
	if err := d.admin.Ping(ctx); err != nil {
		d.close()
		return nil, fmt.Errorf("connecting to %s: %w", u.Redacted(), err)
	}
	if _, err := d.admin.Exec(ctx, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements"); err == nil {
		_, err = d.admin.Exec(ctx, "SELECT FROM pg_stat_statements LIMIT 1")
		d.statements = err == nil
	}
	var pw [12]byte
	_, _ = rand.Read(pw[:])
	d.password = hex.EncodeToString(pw[:])
	return d, nil
}

func (d *database) close() error {
	if d.admin != nil {
		d.admin.Close()
	}
	if d.cluster != nil {
		return d.cluster.Close()
	}
	return nil
}

// addr returns the server's host:port.
func (d *database) addr() string {
	host := d.adminURL.Hostname()
	port := d.adminURL.Port()
	if port == "" {
		port = "5432"
	}
	return net.JoinHostPort(host, port)
}

// ensureRole creates (or resets the password of) a login role for one
// candidate slot, so that the server counts each candidate's statements
// apart. It may read every session's activity, as the advisory strategy
// needs to tell followers how long the holder's session has left.
func (d *database) ensureRole(ctx context.Context, role string) error {
	q := pgx.Identifier{role}.Sanitize()
	_, err := d.admin.Exec(ctx, fmt.Sprintf(`
DO $$ BEGIN
	IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = %s) THEN
		CREATE ROLE %s LOGIN;
	END IF;
END $$`, quoteLiteral(role), q))
	if err == nil {
		_, err = d.admin.Exec(ctx, fmt.Sprintf("ALTER ROLE %s LOGIN PASSWORD %s", q, quoteLiteral(d.password)))
	}
	if err == nil {
		_, err = d.admin.Exec(ctx, fmt.Sprintf("GRANT pg_read_all_stats TO %s", q))
	}
	if err != nil {
		return fmt.Errorf("creating role %s (the benchmark needs a superuser, or CREATEROLE and CREATEDB): %w", role, err)
	}
	return nil
}

func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// createDatabase creates a fresh database for one setup with kind's tables,
// usable by roles.
func (d *database) createDatabase(ctx context.Context, name, kind string, roles []string) error {
	q := pgx.Identifier{name}.Sanitize()
	if _, err := d.admin.Exec(ctx, "DROP DATABASE IF EXISTS "+q+" WITH (FORCE)"); err != nil {
		return err
	}
	if _, err := d.admin.Exec(ctx, "CREATE DATABASE "+q+" TEMPLATE template0"); err != nil {
		return fmt.Errorf("creating database %s: %w", name, err)
	}
	pool, err := pgxpool.New(ctx, d.connString(name, "", ""))
	if err != nil {
		return err
	}
	defer pool.Close()
	switch kind {
	case kindLease, kindAdvisory:
		err = postgres.Migrate(ctx, pool, postgres.Options{})
	case kindSkill:
		_, err = pool.Exec(ctx, skill.Schema)
	case kindClientGo:
		_, err = pool.Exec(ctx, pglock.Schema)
	}
	if err != nil {
		return fmt.Errorf("creating %s's tables in %s: %w", kind, name, err)
	}
	for _, r := range roles {
		ident := pgx.Identifier{r}.Sanitize()
		for _, stmt := range []string{
			"GRANT CONNECT ON DATABASE " + q + " TO " + ident,
			"GRANT USAGE ON SCHEMA public TO " + ident,
			"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO " + ident,
		} {
			if _, err := pool.Exec(ctx, stmt); err != nil {
				return fmt.Errorf("%s: %w", stmt, err)
			}
		}
	}
	return nil
}

func (d *database) dropDatabase(ctx context.Context, name string) error {
	_, err := d.admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
	return err
}

// connString returns a URL for database as role (the admin user if "")
// at hostport (the server if "").
func (d *database) connString(database, role, hostport string) string {
	u := *d.adminURL
	if role != "" {
		u.User = url.UserPassword(role, d.password)
	}
	if hostport != "" {
		u.Host = hostport
	}
	u.Path = "/" + database
	u.RawPath = ""
	return u.String()
}

// serverCounts are the server's own counts for one database.
type serverCounts struct {
	// Statements per role: pg_stat_statements' calls (top-level statements
	// that completed), or nil without pg_stat_statements.
	Statements map[string]int64
	// Transactions committed and rolled back (pg_stat_database). Every
	// statement outside a transaction block is one, and so is a pgx ping
	// (an empty query). Backends report these at most once a second, and
	// within about 10s when idle.
	Transactions int64
	// Connections open now, per role (pg_stat_activity).
	Connections map[string]int64
}

func (d *database) serverCounts(ctx context.Context, database string) (serverCounts, error) {
	var c serverCounts
	if d.statements {
		rows, err := d.admin.Query(ctx, `
SELECT r.rolname, sum(s.calls)::bigint
FROM pg_stat_statements AS s
JOIN pg_roles AS r ON r.oid = s.userid
JOIN pg_database AS db ON db.oid = s.dbid
WHERE db.datname = $1
GROUP BY r.rolname`, database)
		if err != nil {
			return c, err
		}
		c.Statements = map[string]int64{}
		for rows.Next() {
			var role string
			var n int64
			if err := rows.Scan(&role, &n); err != nil {
				return c, err
			}
			c.Statements[role] = n
		}
		if err := rows.Err(); err != nil {
			return c, err
		}
	}
	err := d.admin.QueryRow(ctx, `SELECT coalesce(sum(xact_commit + xact_rollback), 0)::bigint FROM pg_stat_database WHERE datname = $1`, database).
		Scan(&c.Transactions)
	if err != nil {
		return c, err
	}
	rows, err := d.admin.Query(ctx, `SELECT usename, count(*) FROM pg_stat_activity WHERE datname = $1 AND usename IS NOT NULL GROUP BY usename`, database)
	if err != nil {
		return c, err
	}
	c.Connections = map[string]int64{}
	for rows.Next() {
		var role string
		var n int64
		if err := rows.Scan(&role, &n); err != nil {
			return c, err
		}
		c.Connections[role] = n
	}
	return c, errors.Join(rows.Err())
}

// scaleServer is the server's statement counts for a scale measurement's
// database (pg_stat_statements, every role): all statements, the lease
// store's renewal statements (UPDATE ... FROM unnest(...)) with their total
// execution time, and its acquire statements. ok is false without
// pg_stat_statements.
type scaleServer struct {
	ok                      bool
	all, renewals, acquires int64
	renewMs                 float64
}

func (d *database) scaleCounts(ctx context.Context, database string) (scaleServer, error) {
	var c scaleServer
	if !d.statements {
		return c, nil
	}
	err := d.admin.QueryRow(ctx, `
SELECT coalesce(sum(s.calls), 0)::bigint,
	coalesce(sum(s.calls) FILTER (WHERE strpos(s.query, $2) > 0), 0)::bigint,
	coalesce(sum(s.total_exec_time) FILTER (WHERE strpos(s.query, $2) > 0), 0)::float8,
	coalesce(sum(s.calls) FILTER (WHERE strpos(s.query, $3) > 0), 0)::bigint
FROM pg_stat_statements AS s
JOIN pg_database AS db ON db.oid = s.dbid
WHERE db.datname = $1`, database, sqlRenewMark, sqlAcquireMark).Scan(&c.all, &c.renewals, &c.renewMs, &c.acquires)
	c.ok = err == nil
	return c, err
}

// leaseTable is the state of a database's lease table on the server: the
// leases held now (on the server's clock) and their distinct holder IDs;
// from pg_stat_user_tables (reported by backends within a second or so),
// the row updates since the database was created and how many of them
// were HOT (no index entry written); and the table's size with its index.
type leaseTable struct {
	held, holders          int64
	updates, hotUpdates    int64
	deadTuples, totalBytes int64
}

func (d *database) leaseTable(ctx context.Context, database string) (t leaseTable, err error) {
	conn, err := pgx.Connect(ctx, d.connString(database, "", ""))
	if err != nil {
		return t, err
	}
	defer conn.Close(context.Background())
	table := pgx.Identifier{postgres.DefaultSchema, postgres.DefaultTable}.Sanitize()
	beats := pgx.Identifier{postgres.DefaultSchema, postgres.DefaultHeartbeatTable}.Sanitize()
	// A lease under a heartbeat is held while the heartbeat is unexpired
	// and not dead (see the postgres package documentation).
	err = conn.QueryRow(ctx, `SELECT count(*), count(DISTINCT l.holder_id) FROM `+table+` AS l
		LEFT JOIN `+beats+` AS h ON h.id = l.heartbeat AND NOT h.dead
		WHERE l.holder_token IS NOT NULL
			AND CASE WHEN l.heartbeat IS NULL THEN l.expires_at ELSE h.expires_at END > clock_timestamp()`).Scan(&t.held, &t.holders)
	if err != nil {
		return t, err
	}
	err = conn.QueryRow(ctx, `
SELECT coalesce(n_tup_upd, 0), coalesce(n_tup_hot_upd, 0), coalesce(n_dead_tup, 0), pg_total_relation_size(relid)
FROM pg_stat_user_tables WHERE relid = $1::regclass`, table).Scan(&t.updates, &t.hotUpdates, &t.deadTuples, &t.totalBytes)
	return t, err
}
