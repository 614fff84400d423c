package postgres

import (
	"context"
	"fmt"
	"time"

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
func newOwnPool(pool *pgxpool.Pool, opts Options, hosts *hostOrder) (*pgxpool.Pool, error) {
	cfg := pool.Config()
	cfg.ConnConfig = ownConnConfig(pool)
	cfg.MaxConns = opts.MaxConns
	cfg.MinConns = 0
	cfg.MinIdleConns = 0
	cfg.BeforeConnect = hosts.beforeConnect(cfg.BeforeConnect)
	if cfg.ShouldPing == nil {
		cfg.ShouldPing = pingIdleOver(ownPingIdle)
	}
	own, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		return nil, fmt.Errorf("postgres: the store's own connections: %w", err)
	}
	return own, nil
}

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
