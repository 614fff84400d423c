package postgres

import (
	"context"
	"crypto/sha256"
	"embed"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"io/fs"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// migrations holds the schema, one file per change, applied in name order.
// Every statement in them is idempotent (IF NOT EXISTS and the like).
//
//go:embed migrations/*.sql
var migrations embed.FS

// migrateLockKey is the pg_advisory_xact_lock key that serializes Migrate
// calls on one database: the first 8 bytes of the SHA-256 of a string that
// names this function, so that it is unlikely to meet another program's key.
var migrateLockKey = func() int64 {
	sum := sha256.Sum256([]byte("github.com/leaderelect/leader/postgres.Migrate"))
	return int64(binary.BigEndian.Uint64(sum[:8]))
}()

// Migrate creates the tables described by opts (the lease table, the
// advisory strategy's table, the Router's message table, and those named
// after the lease table, of epochs and of candidates; and their schema),
// where missing, adds the columns that an earlier version's tables lack,
// and creates or replaces the status view and the fence function (see
// Fence). It is safe to
// run every time a program starts, from many processes at once: it runs in
// one transaction that first takes a transaction-scoped advisory lock, so
// concurrent calls wait for each other instead of racing on the catalog.
// A schema it has migrated already is left alone: Migrate marks the lease
// table (a comment naming the migrations' hash) and, finding the mark,
// returns without any DDL, which would lock the tables one after another
// and could deadlock with a store's statements or a status read. Otherwise
// it needs the privilege to create the schema (if missing) and tables in
// it, even when they exist (PostgreSQL checks it before IF NOT EXISTS), and
// to own the tables: a program that runs as a role without it must leave
// Migrate to a deploy step (see Privileges in the package documentation).
//
// It returns an *OptionsError if opts break a rule, and an error wrapping
// leader.ErrReadOnly on a read-only server. Under a ctx without a deadline
// it gives up after opts.CallTimeout (30s by default), even on a server
// that accepts the connection and never answers.
func Migrate(ctx context.Context, pool *pgxpool.Pool, opts Options) error {
	if pool == nil {
		return fmt.Errorf("postgres: migrate: pool is nil")
	}
	opts = opts.withDefaults()
	if err := opts.validate(); err != nil {
		return err
	}
	script, err := migrationScript(opts)
	if err != nil {
		return fmt.Errorf("postgres: migrate: %w", err)
	}
	_, hadDeadline := ctx.Deadline()
	ctx, cancel := opts.bound(ctx)
	defer cancel()
	what := fmt.Sprintf("migrate schema %q", opts.Schema)
	if !hadDeadline {
		what += fmt.Sprintf(" (within Options.CallTimeout, %v)", opts.CallTimeout)
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", migrateLockKey); err != nil {
			return fmt.Errorf("taking the migration lock: %w", err)
		}
		// A schema that this script made already is left alone: its DDL,
		// idempotent as it is, would take ACCESS EXCLUSIVE locks on the
		// tables one after another, and a store's statement or a status
		// read that takes them in another order would deadlock with it.
		var done *string
		if err := tx.QueryRow(ctx, "SELECT obj_description(to_regclass($1), 'pg_class')", opts.qualifiedTable()).Scan(&done); err != nil {
			return fmt.Errorf("reading the schema's version: %w", err)
		}
		if done != nil && *done == migratedMark(script) {
			return nil
		}
		// CREATE SCHEMA IF NOT EXISTS needs the CREATE privilege on the
		// database even when the schema exists, so ask first.
		var exists bool
		if err := tx.QueryRow(ctx, "SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)", opts.Schema).Scan(&exists); err != nil {
			return fmt.Errorf("looking for schema %q: %w", opts.Schema, err)
		}
		if !exists {
			if _, err := tx.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{opts.Schema}.Sanitize()); err != nil {
				return fmt.Errorf("creating schema %q: %w", opts.Schema, err)
			}
		}
		if _, err := tx.Exec(ctx, script); err != nil {
			return err
		}
		// The mark is letters, digits and spaces: a literal needs no escaping.
		if _, err := tx.Exec(ctx, "COMMENT ON TABLE "+opts.qualifiedTable()+" IS '"+migratedMark(script)+"'"); err != nil {
			return fmt.Errorf("recording the schema's version: %w", err)
		}
		return nil
	})
	if err != nil {
		return wrapError(ctx, what, err)
	}
	return nil
}

// migratedMark is the comment that Migrate puts on the lease table once
// it has run script: the script's SHA-256, so that a later Migrate with
// the same script (table names included) knows there is nothing to do.
func migratedMark(script string) string {
	sum := sha256.Sum256([]byte(script))
	return "leader schema " + hex.EncodeToString(sum[:16])
}

// migrationScript returns every migration, in order, with the table names
// filled in.
func migrationScript(opts Options) (string, error) {
	names, err := fs.Glob(migrations, "migrations/*.sql")
	if err != nil {
		return "", err
	}
	replacer := strings.NewReplacer(
		"{{table}}", opts.qualifiedTable(),
		"{{advisory_table}}", opts.qualifiedAdvisoryTable(),
		"{{message_table}}", opts.qualifiedMessageTable(),
		"{{message_index}}", opts.messageIndex(),
		"{{heartbeat_table}}", opts.qualifiedHeartbeatTable(),
		"{{heartbeat_index}}", opts.heartbeatIndex(),
		"{{strategy_table}}", opts.qualifiedStrategyTable(),
		"{{status_view}}", opts.qualifiedStatusView(),
		"{{epoch_table}}", opts.qualifiedEpochTable(),
		"{{fence_function}}", opts.qualifiedFenceFunction(),
		"{{fence_quote}}", fenceQuote(opts),
		"{{candidate_table}}", opts.qualifiedCandidateTable(),
		"{{request_index}}", opts.requestIndex(),
		"{{staged_key}}", stageKeySQL(stagedKeyPrefix, opts.qualifiedTable(), "$1"),
		"{{fence_key}}", stageKeySQL(fenceKeyPrefix, opts.qualifiedTable(), "$1"),
	)
	var b strings.Builder
	for _, name := range names { // fs.Glob returns names in lexical order
		sql, err := migrations.ReadFile(name)
		if err != nil {
			return "", err
		}
		b.WriteString(replacer.Replace(string(sql)))
		b.WriteString("\n")
	}
	return b.String(), nil
}

// fenceQuote returns the dollar quote of the fence function's body
// (migration 007): $fence$, or $fence1$, $fence2$... if one of the names
// in the body contains it. Only a name could: the rest of the body does
// not, and a quoted name begins and ends with a double quote, which no
// such quote contains.
func fenceQuote(opts Options) string {
	names := opts.qualifiedTable() + opts.qualifiedHeartbeatTable() + opts.qualifiedAdvisoryTable() + opts.qualifiedStrategyTable()
	quote := "$fence$"
	for i := 1; strings.Contains(names, quote); i++ {
		quote = fmt.Sprintf("$fence%d$", i)
	}
	return quote
}
