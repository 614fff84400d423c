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

// ErrClosed is returned (wrapped) by Watch and PrepareHandover on a
// LeaseStore that was closed.
var ErrClosed = errors.New("postgres: lease store closed")

// wrapError says what failed ("renew \"nightly\"", "migrate"), and classifies err so
// that callers can branch with errors.Is:
//
//   - the context's error when ctx ended (whatever pgx made of it);
//   - leader.ErrReadOnly for SQLSTATE 25006 (read_only_sql_transaction);
//   - leader.ErrUnavailable when the server could not be reached or the
//     connection broke;
//   - leader.ErrPermanent, with what to do, when the server refused for a
//     reason that retrying will not mend (see permanentHint).
//
// pgx's errors name the user and database but never the password.
func wrapError(ctx context.Context, what string, err error) error {
	prefix := "postgres: " + what
	var tags []error
	if ctxErr := ctx.Err(); ctxErr != nil && !errors.Is(err, ctxErr) {
		tags = append(tags, ctxErr)
	}
	switch hint := permanentHint(err); {
	case hint != "":
		prefix += ": " + hint
		tags = append(tags, leader.ErrPermanent)
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

// permanentHint returns what a person must do about err, if the server
// refused for a reason that retrying will not mend, and "" otherwise:
//
//   - 28P01 (invalid_password) and 28000 (invalid_authorization_specification,
//     also pg_hba.conf's "no entry for host"): fix the user or password in
//     the connection string, or the server's pg_hba.conf;
//   - 3D000 (invalid_catalog_name): create the database, or fix its name;
//   - 42P01 (undefined_table) and 3F000 (invalid_schema_name): run
//     "leader migrate" or postgres.Migrate;
//   - 42703 (undefined_column): the tables are of an older version (a
//     newer client before its migration): run it likewise;
//   - 42501 (insufficient_privilege): the GRANT to run, for the object
//     the server named (see Privileges in the package documentation).
func permanentHint(err error) string {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return ""
	}
	switch pgErr.Code {
	case "28P01", "28000":
		return "authentication failed: fix the user or password in the connection string, or the server's pg_hba.conf"
	case "3D000":
		return "the database does not exist: create it, or fix the database name in the connection string"
	case "42P01", "3F000":
		return "the store's tables do not exist: run `leader migrate` or postgres.Migrate (with the same Options) first"
	case "42703":
		return "a column the store uses does not exist: the store's tables are of an older version; run `leader migrate` or postgres.Migrate (with the same Options)"
	case "42501":
		return "the role lacks a privilege: " + grantHint(pgErr.Message)
	}
	return ""
}

// grantHint returns the GRANT that mends a "permission denied" message of
// the server's, as far as the message names the object.
func grantHint(message string) string {
	const role = "<the store's role>"
	if table, ok := strings.CutPrefix(message, "permission denied for table "); ok {
		return fmt.Sprintf("GRANT SELECT, INSERT, UPDATE ON %s TO %s (and DELETE, if it is the heartbeat, the candidates' or the Router's message table); see Privileges in the postgres package documentation", table, role)
	}
	if schema, ok := strings.CutPrefix(message, "permission denied for schema "); ok {
		return fmt.Sprintf("GRANT USAGE ON SCHEMA %s TO %s; see Privileges in the postgres package documentation", schema, role)
	}
	if fn, ok := strings.CutPrefix(message, "permission denied for function "); ok {
		return fmt.Sprintf("GRANT EXECUTE ON FUNCTION %s TO %s (the fence function: see FenceFunction in the postgres package documentation)", fn, role)
	}
	if db, ok := strings.CutPrefix(message, "permission denied for database "); ok {
		return fmt.Sprintf("GRANT CONNECT ON DATABASE %s TO %s; see Privileges in the postgres package documentation", db, role)
	}
	return "see Privileges in the postgres package documentation for the GRANTs the stores need"
}

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
