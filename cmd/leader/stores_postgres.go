//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader/cmd/leader/internal/fence"
	"github.com/leaderelect/leader/postgres"
)

// connectTimeout bounds the first connection to PostgreSQL, so that a wrong
// host fails the command instead of hanging it.
const connectTimeout = 10 * time.Second

// connectWithin returns how long a new connection of cfg may take: pgx
// tries the hosts of a multi-host URL in turn, each for cfg.ConnectTimeout,
// so a host that never answers must not use up the time of those after it.
func connectWithin(cfg *pgconn.Config) time.Duration {
	return max(connectTimeout, time.Duration(1+len(cfg.Fallbacks))*cfg.ConnectTimeout)
}

// postgresPool parses spec's URL and connects, returning the pool and a
// secret-free identity of the database. Errors never quote the URL (pgx's
// own connect errors name only user and database; parse errors are rebuilt
// here from the masked URL).
func postgresPool(ctx context.Context, spec storeSpec) (*pgxpool.Pool, string, error) {
	cfg, err := pgxpool.ParseConfig(spec.raw)
	if err != nil {
		// pgx quotes the URL with the password masked as best it can; say
		// only what is wrong, after the quoted URL, and show our own mask.
		reason := err.Error()
		var pce *pgconn.ParseConfigError
		if errors.As(err, &pce) {
			if i := strings.LastIndex(reason, "`: "); i >= 0 {
				reason = reason[i+3:]
			}
		}
		return nil, "", usagef("--store %s: not a valid PostgreSQL URL: %s", spec.display, reason)
	}
	// Each host of a multi-host URL gets its own connect timeout: the
	// stores' default (postgres.DefaultConnectTimeout) unless the URL's
	// connect_timeout says otherwise, at most connectTimeout, so that a
	// vanished host listed first costs little.
	switch {
	case cfg.ConnConfig.ConnectTimeout == 0:
		cfg.ConnConfig.ConnectTimeout = postgres.DefaultConnectTimeout
	case cfg.ConnConfig.ConnectTimeout > connectTimeout:
		cfg.ConnConfig.ConnectTimeout = connectTimeout
	}
	// A call whose context ends has its statement cancelled on the server
	// too, so a renewal or acquire that timed out waiting for a row lock
	// does not commit later (see the postgres package's Errors section).
	// The connection is cut after a second if the server does not answer.
	cfg.ConnConfig.BuildContextWatcherHandler = func(c *pgconn.PgConn) ctxwatch.Handler {
		return &pgconn.CancelRequestContextWatcherHandler{Conn: c, DeadlineDelay: time.Second}
	}
	id := "postgres:" + net.JoinHostPort(cfg.ConnConfig.Host, strconv.Itoa(int(cfg.ConnConfig.Port))) + "/" + cfg.ConnConfig.Database
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, "", fmt.Errorf("connecting to %s: %w", spec.display, err)
	}
	pctx, cancel := context.WithTimeout(ctx, connectWithin(&cfg.ConnConfig.Config))
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		return nil, "", fmt.Errorf("connecting to %s: %w", spec.display, err)
	}
	return pool, id, nil
}

// minAdvisoryServer is the oldest server (server_version_num) that can serve
// the advisory strategy: PostgreSQL 14, the first with idle_session_timeout,
// with which the server frees a vanished leader's lock. The postgres package
// checks it too; checking here first lets the message name the flags.
const minAdvisoryServer = 140000

// openPostgres opens the store of spec's strategy: for an election
// (spec.election), the strategy the store records for it. Unless
// forMigrate, it checks that the strategy's table exists, so that a
// forgotten "leader migrate" is reported once, clearly, instead of on every
// store call; for the advisory strategy it also checks that the server can
// serve it, and refuses with a usage error a server that cannot: the flags
// (or the URL) ask for something this store cannot do.
func openPostgres(ctx context.Context, spec storeSpec, log *slog.Logger, forMigrate bool) (*openedStore, error) {
	pool, id, err := postgresPool(ctx, spec)
	if err != nil {
		return nil, err
	}
	opts := postgres.Options{Logger: log}
	leases, err := postgres.NewLeaseStore(pool, opts)
	if err != nil {
		pool.Close()
		return nil, err
	}
	full := leases.Options()
	s := &openedStore{
		Store:    leases,
		kind:     postgresStore,
		strategy: spec.strategy,
		display:  spec.display,
		id:       id,
		fenceDir: fence.HostDir(),
		migrate:  func(ctx context.Context) error { return postgres.Migrate(ctx, pool, opts) },
		strategyOf: func(ctx context.Context, name string) (string, error) {
			strategy, err := postgres.StrategyOf(ctx, pool, opts, name)
			return string(strategy), err
		},
		close: func() {
			leases.Close()
			pool.Close()
		},
	}
	if forMigrate {
		// Migrate creates every table.
		return s, nil
	}
	if spec.election != "" {
		strategy, err := recordedStrategy(ctx, spec, pool, s, full)
		if err != nil {
			s.Close()
			return nil, err
		}
		if strategy != "" {
			s.strategy = strategy
		}
	}
	if s.strategy == strategyAdvisory {
		advisory, err := openAdvisory(ctx, spec, pool, opts, full, s.strategy != spec.strategy)
		if err != nil {
			s.Close()
			return nil, err
		}
		s.Store = advisory
		s.close = func() {
			advisory.Close()
			leases.Close()
			pool.Close()
		}
	} else if err := checkTable(ctx, spec, pool, "lease table", full.Schema, full.Table); err != nil {
		s.Close()
		return nil, err
	}
	log.Debug("store opened", slog.String("store", spec.display), slog.String("strategy", s.strategy))
	return s, nil
}

// recordedStrategy returns the strategy that s records for spec.election,
// "" if it was never elected, after checking that the strategy table
// exists.
func recordedStrategy(ctx context.Context, spec storeSpec, pool *pgxpool.Pool, s *openedStore, full postgres.Options) (string, error) {
	if err := checkTable(ctx, spec, pool, "strategy table", full.Schema, full.StrategyTable); err != nil {
		return "", err
	}
	ctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	strategy, err := s.strategyOf(ctx, spec.election)
	if err != nil {
		return "", fmt.Errorf("finding the strategy of election %q on %s: %w", spec.election, spec.display, err)
	}
	return strategy, nil
}

// checkTable reports, as an error that says to run "leader migrate", if
// the table schema.table (what names it for people) does not exist.
func checkTable(ctx context.Context, spec storeSpec, pool *pgxpool.Pool, what, schema, table string) error {
	name := pgx.Identifier{schema, table}.Sanitize()
	var found *string
	qctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	if err := pool.QueryRow(qctx, "SELECT to_regclass($1)::text", name).Scan(&found); err != nil {
		return fmt.Errorf("looking for the %s on %s: %w", what, spec.display, err)
	}
	if found == nil {
		return fmt.Errorf("the %s %s does not exist on %s: run \"leader migrate\" with this store first", what, name, spec.display)
	}
	return nil
}

// openAdvisory opens the advisory store on pool, after checking what can be
// checked with a clearer message than the postgres package's: the server's
// version (a usage error) and the table. A pooler shows only on the store's
// own connection; NewAdvisoryStore reports it, and it is a usage error too.
// recorded says that the strategy is the one the store records for
// spec.election, not one --strategy asked for: the messages then name the
// election, and do not offer --strategy lease.
func openAdvisory(ctx context.Context, spec storeSpec, pool *pgxpool.Pool, opts, full postgres.Options, recorded bool) (*postgres.AdvisoryStore, error) {
	ctx, cancel := context.WithTimeout(ctx, connectWithin(&pool.Config().ConnConfig.Config)) // NewAdvisoryStore connects
	defer cancel()
	const pooler = "a connection pooler (such as PgBouncer in transaction mode: statements run in another server process than the one that accepted the connection)"
	subject := "--strategy advisory"
	upgradeAdvice := "use --strategy lease (the default), or upgrade the server"
	pooled := fmt.Sprintf("--strategy advisory needs a direct connection to PostgreSQL, but %s goes through %s, "+
		"where the leader's lock would stay on a server connection that other clients go on using; "+
		"give a URL that reaches PostgreSQL directly, or use --strategy lease (the default), which works through a pooler",
		spec.display, pooler)
	if recorded {
		subject = fmt.Sprintf("election %q is elected with the advisory strategy, which", spec.election)
		upgradeAdvice = "upgrade the server"
		pooled = fmt.Sprintf("election %q is elected with the advisory strategy, whose leader can be looked at only over a direct connection to PostgreSQL, "+
			"but %s goes through %s; give a URL that reaches PostgreSQL directly", spec.election, spec.display, pooler)
	}
	var (
		version     int
		versionText string
	)
	err := pool.QueryRow(ctx, "SELECT current_setting('server_version_num')::int, current_setting('server_version')").Scan(&version, &versionText)
	if err != nil {
		return nil, fmt.Errorf("reading the server version of %s: %w", spec.display, err)
	}
	if version < minAdvisoryServer {
		return nil, usagef("%s needs PostgreSQL 14 or later, but %s runs PostgreSQL %s: %s",
			subject, spec.display, versionText, upgradeAdvice)
	}
	if err := checkTable(ctx, spec, pool, "advisory strategy's table", full.Schema, full.AdvisoryTable); err != nil {
		return nil, err
	}
	advisory, err := postgres.NewAdvisoryStore(ctx, pool, opts)
	switch {
	case errors.Is(err, postgres.ErrPooledSession):
		return nil, usagef("%s", pooled)
	case err != nil:
		return nil, fmt.Errorf("opening the advisory store on %s: %w", spec.display, err)
	}
	return advisory, nil
}
