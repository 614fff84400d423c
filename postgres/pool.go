package postgres

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// newOwnPool returns the small pool of a store's own connections, made
// from the caller's pool's configuration (the same server, credentials,
// TLS and hooks): the store's statements never wait for one of the
// caller's connections, so a service whose own work holds every
// connection of its pool does not lose its leadership to that (see
// Options.MaxConns). The pool opens connections as they are needed, at
// most opts.MaxConns, in the background (a call that gives up does not
// cut a connection short: the next call gets it), each with a connect
// timeout per host (see ownConnConfig), trying the hosts in the order of
// hosts (see hostOrder). (No statement_timeout is added to the start-up
// parameters: PgBouncer refuses unknown ones; every call is bounded by
// its context, see Options.bound.) The store closes it in its Close.
func newOwnPool(pool *pgxpool.Pool, opts Options, hosts *hostOrder, warm ...string) (*pgxpool.Pool, error) {
	cfg := pool.Config()
	cfg.ConnConfig = ownConnConfig(pool)
	cfg.MaxConns = opts.MaxConns
	cfg.MinConns = 0
	cfg.MinIdleConns = 0
	cfg.BeforeConnect = hosts.beforeConnect(cfg.BeforeConnect)
	if cfg.ShouldPing == nil {
		cfg.ShouldPing = pingIdleOver(ownPingIdle)
	}
	if cfg.BeforeAcquire != nil || cfg.PrepareConn != nil || cfg.AfterRelease != nil {
		// The caller's pool may reset its sessions between uses
		// (DISCARD ALL, say), which would take statements prepared
		// ahead from under pgx, which knows nothing of it: plan nothing
		// ahead.
		warm = nil
	} else {
		cfg.AfterConnect = genericPlans(cfg.AfterConnect, opts.Logger, warm)
	}
	own, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		return nil, fmt.Errorf("postgres: the store's own connections: %w", err)
	}
	return own, nil
}

// genericPlans returns a pgxpool AfterConnect hook that runs after, if
// any, and then readies a new connection for the store's statements (see
// planAhead), best effort: a failure is logged, and the connection is
// used as it is.
func genericPlans(after func(context.Context, *pgx.Conn) error, log *slog.Logger, warm []string) func(context.Context, *pgx.Conn) error {
	return func(ctx context.Context, conn *pgx.Conn) error {
		if after != nil {
			if err := after(ctx, conn); err != nil {
				return err
			}
		}
		// Bounded: pgxpool gives the hook a context that ends only with
		// the pool, and the pool has few connections.
		pctx, cancel := context.WithTimeout(ctx, listenCallTimeout)
		defer cancel()
		if err := planAhead(pctx, conn, warm); err != nil {
			if ctx.Err() != nil {
				return err
			}
			log.Debug("planning the store's statements on a new connection failed; they are planned as they run",
				slog.Any("error", err))
		}
		return nil
	}
}

// planAhead sets plan_cache_mode to force_generic_plan for conn's session
// (PostgreSQL 12 and later), so that the store's statements, prepared on
// the connection by pgx, are planned once rather than at each run, and
// has the server plan the statements warm (prepared as pgx prepares a
// statement it caches) without running them (EXPLAIN of the prepared
// statement, which keeps the plan with it). A connection runs an acquire
// or a release a few times in its life (a follower's attempt once per
// TTL, a release once per tenure): too few for the server's own choice,
// a custom plan for each of the first five runs of a prepared statement,
// to come to the generic plan, which for the store's statements, lookups
// by key, is the same plan. Planned at their first run, an acquire took
// 1.1 ms on the server and a release 0.5 ms, against 0.3 and 0.2 ms
// planned ahead; and a statement's first run on a connection adds the
// round trip of its preparation, and on a new backend the reading of the
// catalog. Nothing is set or planned where the statement does not run in
// the backend that the connection started with (behind a pooling proxy
// the setting would stay with a server connection that others use), nor
// in another mode than pgx's default, cache_statement (the simple
// protocol prepares nothing, and the others unnamed statements, planned
// at each run anyway).
func planAhead(ctx context.Context, conn *pgx.Conn, warm []string) error {
	if conn.Config().DefaultQueryExecMode != pgx.QueryExecModeCacheStatement {
		return nil
	}
	var set bool
	err := conn.QueryRow(ctx, fmt.Sprintf(`SELECT true FROM (SELECT set_config('plan_cache_mode', 'force_generic_plan', false)
	WHERE current_setting('server_version_num')::int >= 120000 AND pg_backend_pid() = %d) AS x`, conn.PgConn().PID()),
		pgx.QueryExecModeSimpleProtocol).Scan(&set)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil
	}
	if err != nil || len(warm) == 0 {
		return err
	}
	var explain strings.Builder
	for _, sql := range warm {
		// Prepared under the name pgx gives a statement whose name is
		// its text, which Query then finds and runs.
		sd, err := conn.Prepare(ctx, sql, sql)
		if err != nil {
			return err
		}
		args := "" // EXECUTE takes no parentheses without parameters
		if len(sd.ParamOIDs) > 0 {
			args = "(" + strings.TrimSuffix(strings.Repeat("NULL, ", len(sd.ParamOIDs)), ", ") + ")"
		}
		fmt.Fprintf(&explain, "EXPLAIN (COSTS OFF) EXECUTE %s%s;\n", pgx.Identifier{sd.Name}.Sanitize(), args)
	}
	explain.WriteString(warmUp)
	_, err = conn.Exec(ctx, explain.String(), pgx.QueryExecModeSimpleProtocol)
	return err
}

// warmUp is the last statement of planAhead's batch: it calls, once, the
// functions and operators that a grant and a release call as they run.
// EXPLAIN plans a statement without running it, so a backend's first
// release would still look up, as it runs, what each function call needs
// (the catalog), set up the SHA-256 of the candidate channels, and create
// the release's own settings (namedChannelSetting, namedPayloadSetting);
// and a session of the advisory strategy most often releases once in its
// life. Measured once on one store, an advisory session's first named
// release took 0.5 ms more than a later one, and the same after this
// statement; in one bench run, the advisory strategy's release statement
// ran in 0.94 ms on the server on average before, and 0.22 ms after. It
// sets only the release's own settings, to the empty value that means
// "named nobody", on a connection that has not released yet.
const warmUp = `SELECT left(encode(sha256(convert_to(x.v, 'UTF8')), 'hex'), 2), octet_length(x.v) + 1, x.v || '~' || x.v,
	set_config('` + namedChannelSetting + `', '', false), set_config('` + namedPayloadSetting + `', '', false),
	coalesce(current_setting('` + namedChannelSetting + `', true), ''),
	clock_timestamp() - x.t < (x.t - x.t) / 2, coalesce(x.t > clock_timestamp() - 90 * interval '1 second', false),
	(extract(epoch FROM x.t - clock_timestamp()) * 1000000)::bigint
FROM (VALUES ('w'::text, now())) AS x(v, t);
`

// ownPingIdle is how long one of a store's own connections must have
// been idle for the pool to ping it before handing it out, unless the
// caller's pool sets Config.ShouldPing. pgxpool's default is a second,
// which would add a round trip to nearly every store call: a follower's
// attempt once per TTL, and a successor's grant, which a handover waits
// for. A connection that the server closed meanwhile fails its call
// instead, at once, and the Elector tries again on another; a ping would
// not have noticed a connection that went silent any sooner than the
// call does (see Options.CallTimeout).
const ownPingIdle = time.Minute

// pingIdleOver returns a pgxpool ShouldPing that pings the connections
// idle for longer than d.
func pingIdleOver(d time.Duration) func(context.Context, pgxpool.ShouldPingParams) bool {
	return func(_ context.Context, p pgxpool.ShouldPingParams) bool { return p.IdleDuration > d }
}

// bound returns ctx, bounded by opts.CallTimeout if it has no deadline of
// its own: every store call ends even under context.Background().
func (o Options) bound(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, o.CallTimeout)
}

// exhausted returns a note on pool's use for an error of a call that
// waited for one of its connections past its context's end, "" otherwise.
func exhausted(ctx context.Context, pool *pgxpool.Pool) string {
	if ctx.Err() == nil {
		return ""
	}
	st := pool.Stat()
	if st.AcquiredConns() < st.MaxConns() {
		return ""
	}
	return fmt.Sprintf("all %d of the store's own connections were in use (the server is slow to answer, or the store serves too many calls for Options.MaxConns)", st.MaxConns())
}
