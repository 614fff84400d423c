package postgres

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// ErrPooledSession means a connection does not talk to one server session
// of its own: a connection pooler or proxy that speaks the PostgreSQL
// protocol (PgBouncer, pgcat, Odyssey, RDS Proxy, ...) sits between the
// client and the server. In transaction or statement pooling mode such a
// proxy hands each transaction to whichever server connection is free, so
// session state does not follow the client: a session advisory lock stays
// on a server connection that other clients go on using, and LISTEN
// registers a server connection that may never pass the notifications back.
//
// The advisory strategy and the Router need a session and refuse to work
// without one; the lease strategy keeps working, its followers waking at
// the lease's expiry instead of at a notification. Give them a connection
// string that reaches PostgreSQL directly. (A pooler in session mode would
// keep the session, but it cannot be told apart from one in transaction
// mode, so it is refused too.)
var ErrPooledSession = errors.New("postgres: the connection has no session of its own with the server (a transaction-pooling proxy such as PgBouncer is in between)")

// checkSession reports, with an error wrapping ErrPooledSession, whether
// conn reaches the server through a pooler or proxy: the process ID that
// the server gave at connection start-up (BackendKeyData) is then the
// proxy's, not that of the backend that runs the connection's statements.
// A plain TCP proxy passes the server's own start-up message through and is
// not reported. what says who needs the session, for the message.
func checkSession(ctx context.Context, conn *pgx.Conn, what string) error {
	var backend uint32
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&backend); err != nil {
		return err
	}
	if startup := conn.PgConn().PID(); startup != backend {
		return fmt.Errorf("%w: %s needs one: the server reported backend process %d at connection start-up, but statements run in process %d; connect directly to PostgreSQL",
			ErrPooledSession, what, startup, backend)
	}
	return nil
}
