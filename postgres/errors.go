package postgres

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"syscall"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/leaderelect/leader"
)

// ErrClosed is returned (wrapped) by Watch on a LeaseStore that was closed.
var ErrClosed = errors.New("postgres: lease store closed")

// wrapError says what failed ("renew \"nightly\"", "migrate"), and classifies err so
// that callers can branch with errors.Is:
//
//   - the context's error when ctx ended (whatever pgx made of it);
//   - leader.ErrReadOnly for SQLSTATE 25006 (read_only_sql_transaction);
//   - leader.ErrUnavailable when the server could not be reached or the
//     connection broke.
//
// pgx's errors name the user and database but never the password.
func wrapError(ctx context.Context, what string, err error) error {
	prefix := "postgres: " + what
	var tags []error
	if ctxErr := ctx.Err(); ctxErr != nil && !errors.Is(err, ctxErr) {
		tags = append(tags, ctxErr)
	}
	switch {
	case isReadOnly(err):
		tags = append(tags, leader.ErrReadOnly)
	case ctx.Err() != nil:
		// The context cut the call short; that is its own cause, not an
		// unreachable server.
	case isUnavailable(err):
		tags = append(tags, leader.ErrUnavailable)
	}
	switch len(tags) {
	case 0:
		return fmt.Errorf("%s: %w", prefix, err)
	case 1:
		return fmt.Errorf("%s: %w: %w", prefix, tags[0], err)
	default:
		return fmt.Errorf("%s: %w: %w: %w", prefix, tags[0], tags[1], err)
	}
}

// call names an operation on an election name for wrapError.
func call(op, name string) string { return fmt.Sprintf("%s %q", op, name) }

// sqlState returns err's SQLSTATE, or "" if the server did not send one.
func sqlState(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

func isReadOnly(err error) bool { return sqlState(err) == "25006" }

// isUnavailable reports whether err means the server could not be reached or
// the connection broke: a failed connection attempt, a network error, a
// connection closed under the call, or a server that says it is shutting
// down, starting up, out of connections, or that the connection failed.
func isUnavailable(err error) bool {
	var connectErr *pgconn.ConnectError
	var netErr net.Error
	switch {
	case errors.As(err, &connectErr),
		errors.As(err, &netErr),
		errors.Is(err, io.EOF),
		errors.Is(err, io.ErrUnexpectedEOF),
		errors.Is(err, net.ErrClosed),
		errors.Is(err, pgconn.ErrConnClosed),
		errors.Is(err, syscall.ECONNREFUSED),
		errors.Is(err, syscall.ECONNRESET),
		errors.Is(err, syscall.EPIPE):
		return true
	}
	switch code := sqlState(err); {
	case strings.HasPrefix(code, "08"), // connection_exception
		code == "57P01", // admin_shutdown
		code == "57P02", // crash_shutdown
		code == "57P03", // cannot_connect_now
		code == "53300": // too_many_connections
		return true
	}
	return false
}
