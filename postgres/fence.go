package postgres

import (
	"context"
	"errors"
	"fmt"
	"math"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/leaderelect/leader"
)

// FenceSQLState is the SQLSTATE of the error that the fence function
// raises when the term it was given does not hold the lease (see
// FenceFunction). The error aborts the transaction.
const FenceSQLState = "LF001"

// Fence makes tx, a transaction on the election's database, commit only if
// term still holds the lease of the election name: call it in the
// transaction of the leader's writes, before the commit, with the term its
// work runs under (leader.TermFrom of the leader context). It works for
// both strategies.
//
// If term holds the lease, Fence returns nil, and no later term of name can
// be granted until tx ends: tx may commit, and every write in it lands
// before anything the next leader writes. Otherwise (the lease was
// released, ran out or was granted again, or name is another strategy's
// now) it returns an error wrapping leader.ErrLeaseLost, and the server has
// aborted tx: roll it back; nothing it wrote is ever visible, and a Commit
// fails. Any other error (the server unreachable, ctx ended, the function
// missing: run Migrate) leaves tx unusable too. It returns an
// *OptionsError if opts break a rule; opts must be those of Migrate.
//
// Why this is safe. Fence calls the fence function (see FenceFunction),
// which in tx locks the name's row of the strategy table FOR KEY SHARE and
// then the lease row of the name's strategy FOR SHARE (the lease table's
// row, or the advisory strategy's), and only then judges that row, as the
// last committed grant left it, on the server's clock: it must name term
// and be held, that is unexpired under its own expiry or its heartbeat's
// (lease strategy), or its lock held by the backend the row names
// (advisory strategy). Every grant writes the lease row in the statement
// that grants it (an advisory grant takes the lock and writes the row in
// one statement, so it cannot return before the row is written), and
// moving a name to the other strategy locks its strategy row FOR UPDATE:
// each of them waits for tx to end, and a grant that committed before
// Fence took its locks has a term above term. So however late the holder's
// writes come (its process paused past the TTL, its connection delayed),
// they commit before any later leader is granted the name, or never. And
// since they live in the lease's database, a failover that keeps the
// committed grants (a synchronous standby) keeps them in that order; one to
// an asynchronous standby, which can lose grants, grants nothing for a TTL
// after the promotion and only terms above every earlier one (see Failover
// in the package documentation), so a term is never held by two.
//
// A handover's release that is staged (see "Staged handovers" in the
// package documentation) holds the lease row's lock from before the old
// leader's OnDemoted until its commit after it; the function then judges
// the row's committed version without waiting for that lock (FOR KEY
// SHARE), and holds the name's fence lock in shared mode, which the
// release's commit waits for, and so does every grant, once it has
// written the row: the old term's fenced writes in OnDemoted neither wait
// for their own release nor commit after any later grant, however the
// staged release ends.
//
// While tx is open, a takeover of the lease waits for it (for the row's
// lock, or for the fence lock when tx fenced while a release was
// staged), and, unless tx fenced while a release was staged, so do a
// release and a renewal that writes the lease row: the lease strategy's
// Electors renew in heartbeats (RenewBatch), which write it only in the
// first round after a grant (the heartbeat row is never locked), and the
// advisory strategy's renewals write it only when the TTL changes. Keep
// fenced transactions short, well under the election's RenewInterval.
// Fence one name per transaction: locks on two could deadlock with a
// renewal round, which PostgreSQL breaks by failing one of them (SQLSTATE
// 40P01). In a REPEATABLE READ or SERIALIZABLE transaction, call Fence
// first: a lease row changed since the transaction's snapshot fails it
// with SQLSTATE 40001, to be retried.
func Fence(ctx context.Context, tx pgx.Tx, opts Options, name string, term uint64) error {
	opts = opts.withDefaults()
	if err := opts.validate(); err != nil {
		return err
	}
	const op = "fence"
	if tx == nil {
		return fmt.Errorf("postgres: %s %q: tx is nil", op, name)
	}
	ctx, cancel := opts.bound(ctx)
	defer cancel()
	// A term above any bigint was never granted; 0 never is either, and
	// the function refuses it, which aborts tx as for any other refusal.
	var sqlTerm int64
	if term <= math.MaxInt64 {
		sqlTerm = int64(term)
	}
	_, err := tx.Exec(ctx, "SELECT "+opts.qualifiedFenceFunction()+"($1, $2)", name, sqlTerm)
	var pgErr *pgconn.PgError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &pgErr) && pgErr.Code == FenceSQLState:
		return fmt.Errorf("postgres: %s %q term %d: %w: %w", op, name, term, leader.ErrLeaseLost, err)
	case errors.As(err, &pgErr) && pgErr.Code == "42883": // undefined_function
		return fmt.Errorf("postgres: %s %q: the fence function %s does not exist: run `leader migrate` or postgres.Migrate (with the same Options) first: %w: %w",
			op, name, opts.qualifiedFenceFunction(), leader.ErrPermanent, err)
	}
	return wrapError(ctx, call(op, name), err)
}

// FenceFunction returns the quoted, schema-qualified name of the fence
// function that Migrate creates for opts: the lease table's name followed
// by "_fence", in the tables' schema ("public"."leader_leases_fence" with
// the default Options; a name longer than 63 bytes is shortened like
// Options.Channel). Fence calls it; programs in other languages, and the
// leader command's children, call it in their own transactions, with the
// election name and the term (LEADER_NAME and LEADER_TERM):
//
//	BEGIN;
//	SELECT leader_leases_fence('nightly-report', 7);
//	INSERT INTO reports ...;
//	COMMIT;
//
// It returns nothing if the term holds the lease, and locks the lease
// until the transaction ends, as Fence does; otherwise it raises an error
// with SQLSTATE FenceSQLState (LF001), whose message names the term and
// the election and whose detail says which term holds the lease, if any.
// The error aborts the transaction, so a psql script run with
// ON_ERROR_STOP=1, or a client that stops at the first error, never
// commits it.
//
// It runs with the caller's privileges (SECURITY INVOKER), and its row
// locks need UPDATE on the tables: the stores' role, which has every grant
// listed under Privileges in the package documentation, may call it.
// PostgreSQL lets PUBLIC execute a new function; where the database's
// default privileges revoke that, grant it:
//
//	GRANT EXECUTE ON FUNCTION public.leader_leases_fence(text, bigint) TO leader_app;
func FenceFunction(opts Options) string {
	return opts.withDefaults().qualifiedFenceFunction()
}
