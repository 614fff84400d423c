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
	if cfg.ConnConfig.ConnectTimeout == 0 || cfg.ConnConfig.ConnectTimeout > connectTimeout {
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
	pctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		return nil, "", fmt.Errorf("connecting to %s: %w", spec.display, err)
	}
	return pool, id, nil
}

// openPostgres opens the lease-table store. Unless forMigrate, it checks
// that the lease table exists, so that a forgotten "leader migrate" is
// reported once, clearly, instead of on every store call.
func openPostgres(ctx context.Context, spec storeSpec, log *slog.Logger, forMigrate bool) (*openedStore, error) {
	pool, id, err := postgresPool(ctx, spec)
	if err != nil {
		return nil, err
	}
	opts := postgres.Options{Logger: log}
	store, err := postgres.NewLeaseStore(pool, opts)
	if err != nil {
		pool.Close()
		return nil, err
	}
	if !forMigrate {
		full := store.Options()
		table := pgx.Identifier{full.Schema, full.Table}.Sanitize()
		var found *string
		qctx, cancel := context.WithTimeout(ctx, connectTimeout)
		err := pool.QueryRow(qctx, "SELECT to_regclass($1)::text", table).Scan(&found)
		cancel()
		if err != nil {
			store.Close()
			pool.Close()
			return nil, fmt.Errorf("looking for the lease table on %s: %w", spec.display, err)
		}
		if found == nil {
			store.Close()
			pool.Close()
			return nil, fmt.Errorf("the lease table %s does not exist on %s: run \"leader migrate\" with this store first", table, spec.display)
		}
	}
	log.Debug("store opened", slog.String("store", spec.display))
	return &openedStore{
		Store:    store,
		kind:     postgresStore,
		display:  spec.display,
		id:       id,
		fenceDir: fence.HostDir(),
		migrate:  func(ctx context.Context) error { return postgres.Migrate(ctx, pool, opts) },
		close: func() {
			store.Close()
			pool.Close()
		},
	}, nil
}
