package postgres

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"strconv"
	"time"

	"github.com/leaderelect/leader"
)

// A staged release (see "Staged handovers" in the package documentation)
// and the fence function order themselves by two transaction-level
// advisory locks of each name, in the bigint key space:
//
//   - the staged lock, which a staged release takes (exclusive, never
//     waiting) once its statement has updated the lease row, and keeps
//     until its COMMIT; the fence function tries it in shared mode, and,
//     finding it taken, knows that the row's lock is the staged
//     release's;
//   - the fence lock, which the fence function then takes in shared mode,
//     and which the staged release's commit takes (exclusive) just before
//     its COMMIT, so that it waits for every fenced transaction that
//     judged the row while the release was staged; and which every grant
//     takes once it has written the row (fenceAfterGrant), so that it
//     waits for them too, however the staged release ended.
//
// Each key is the first 8 bytes (big-endian, as a bigint) of the SHA-256
// of a prefix, the lease table's quoted, schema-qualified name, a colon
// and the election name, as UTF-8: 64 bits, so that two names (or another
// program's key) share one with a negligible chance. Go computes them for
// the stores' statements (stagedKey, fenceKey), and SQL for the fence
// function (stageKeySQL): TestStageKeysAgree holds them equal.
const (
	stagedKeyPrefix = "leader:staged:"
	fenceKeyPrefix  = "leader:fence:"
)

// stageKeyOf is the key of prefix for name in table (see stagedKeyPrefix).
func stageKeyOf(prefix, table, name string) int64 {
	sum := sha256.Sum256([]byte(prefix + table + ":" + name))
	return int64(binary.BigEndian.Uint64(sum[:8]))
}

// stagedKey is the staged lock's key of name (see stagedKeyPrefix).
func (o Options) stagedKey(name string) int64 {
	return stageKeyOf(stagedKeyPrefix, o.qualifiedTable(), name)
}

// fenceKey is the fence lock's key of name (see stagedKeyPrefix).
func (o Options) fenceKey(name string) int64 {
	return stageKeyOf(fenceKeyPrefix, o.qualifiedTable(), name)
}

// stageKeySQL returns the SQL expression of stageKeyOf(prefix, table,
// name), for the election name given by the text expression name. The
// prefix and table are given in hex, so that no quoting of the table's
// name can change them.
func stageKeySQL(prefix, table, name string) string {
	return `('x' || left(encode(sha256(decode('` + hex.EncodeToString([]byte(prefix+table+":")) +
		`', 'hex') || convert_to(` + name + `, 'UTF8')), 'hex'), 16))::bit(64)::bigint`
}

// stagedFenceSQL is true if the function whose signature is $5 (see
// stagedFenceSignature) is a fence function that orders itself against
// staged releases (see stagedKeyPrefix): one from before staged releases
// waits for the lease row's lock, which a staged release holds until after
// OnDemoted, so a fenced write in OnDemoted would wait for its own
// release. A staged release's statement after its update (stageLocks,
// stageLocksLease) checks it, so that a schema migrated by an older
// version (a rollback, or a rollout of mixed versions) is never staged on.
const stagedFenceSQL = `EXISTS (SELECT FROM pg_proc AS p
	WHERE p.oid = to_regprocedure($5) AND p.prosrc LIKE '%pg_try_advisory_xact_lock_shared(%')`

// stagedFenceSignature is the signature of the fence function of opts,
// for stagedFenceSQL.
func stagedFenceSignature(opts Options) string {
	return opts.qualifiedFenceFunction() + "(text, bigint)"
}

// isLockTimeout reports whether err is a statement's lock_timeout running
// out (SQLSTATE 55P03, lock_not_available).
func isLockTimeout(err error) bool { return sqlState(err) == "55P03" }

// fenceAfterGrant returns the CTE "fenced" of a grant statement, whose
// CTE "granted" writes the row of the name $1 that it grants: once
// granted, it takes the name's fence lock, which a fenced transaction that
// judged the row while a release was staged holds in shared mode (see
// stagedKeyPrefix), so that the grant commits after it. Such a
// transaction locked the row only FOR KEY SHARE, which the grant's update
// does not wait for; if the staged release ended otherwise than by its
// commit (rolled back: late, aborted, its session gone), the next grant
// would not wait for the fenced transaction but for this lock. It is
// taken after the row's update, so that a grant waiting for a staged
// release's row lock does not hold it (the staged commit takes it). The
// statement must read "fenced" for it to run.
func fenceAfterGrant(opts Options) string {
	return `fenced AS MATERIALIZED (
	SELECT pg_advisory_xact_lock(` + stageKeySQL(fenceKeyPrefix, opts.qualifiedTable(), "$1") + `) FROM granted LIMIT 1
)`
}

// commitWait returns the lock_timeout of a staged release's wait for the
// name's fence lock at its commit (stagedUnlock, stagedUnlockLease): what
// ctx leaves, so that the server gives up when the client does (which
// closes the connection, and the transaction with it), at least 1 ms; or
// none (0) without a deadline.
func commitWait(ctx context.Context) string {
	dl, ok := ctx.Deadline()
	if !ok {
		return "0"
	}
	return strconv.FormatInt(max(time.Until(dl).Milliseconds(), 1), 10)
}

// stagedTxnSettings are the transaction-local settings (three columns)
// that a staged release's statement after its release sets (stageLocks,
// stageLocksLease): no lock_timeout and no statement_timeout, so that its
// commit waits for the fenced transactions that hold the name's fence
// lock (as long as the commit's context allows: stagedUnlock and
// stagedUnlockLease set the lock_timeout then), and
// client_connection_check_interval (PostgreSQL 14 and later), so that the
// server ends that wait if the client went.
const stagedTxnSettings = `set_config('lock_timeout', '0', true), set_config('statement_timeout', '0', true),
	CASE WHEN current_setting('server_version_num')::int >= 140000
		THEN set_config('client_connection_check_interval', '100', true) END`

// stagedRelease is what a prepared handover's Stage staged: set once it
// ran the release in a transaction left open, for reason and hold, at at.
type stagedRelease struct {
	staged bool
	reason leader.GrantReason
	hold   time.Duration
	at     time.Time
}

// stale reports whether the staged release, committed now, would leave
// less than half of its hold behind it (its grant's and reservation's
// times are Stage's): Commit then rolls it back and releases afresh.
func (r stagedRelease) stale() bool {
	return r.staged && time.Since(r.at) > r.hold/2
}

// mismatch returns the error of a Commit of the handover of name under
// term to successor, for reason and hold, that are not those the release
// was staged for; nil if they are, or nothing was staged.
func (r stagedRelease) mismatch(name string, term uint64, successor leader.Candidate, reason leader.GrantReason, hold time.Duration) error {
	if !r.staged || (reason == r.reason && hold == r.hold) {
		return nil
	}
	return fmt.Errorf("postgres: release %q term %d to %s: committed for reason %q and hold %v, staged for %q and %v",
		name, term, successor.ID, reason, hold, r.reason, r.hold)
}
