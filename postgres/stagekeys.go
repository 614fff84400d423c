package postgres

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"sync/atomic"

	"github.com/jackc/pgx/v5/pgxpool"
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
//     judged the row while the release was staged.
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

// stagedFence remembers whether the schema's fence function orders
// itself against staged releases (see stagedKeyPrefix): one from before
// staged releases waits for the lease row's lock, which a staged release
// holds until after OnDemoted, so a fenced write in OnDemoted would wait
// for its own release. A store stages nothing until it has seen the
// function's source take the staged lock; once seen, it does not look
// again (Migrate never puts an older function back).
type stagedFence struct{ seen atomic.Bool }

// stagedFenceSQL says whether the function $1 (its signature) takes the
// staged lock.
const stagedFenceSQL = `SELECT coalesce((SELECT p.prosrc LIKE '%pg_try_advisory_xact_lock_shared(%' FROM pg_proc AS p
	WHERE p.oid = to_regprocedure($1)), false)`

// ok reports whether the fence function of opts orders itself against
// staged releases, asking the server on pool until it has said so once. A
// failed look says no.
func (f *stagedFence) ok(ctx context.Context, pool *pgxpool.Pool, opts Options) bool {
	if f.seen.Load() {
		return true
	}
	var yes bool
	if err := pool.QueryRow(ctx, stagedFenceSQL, opts.qualifiedFenceFunction()+"(text, bigint)").Scan(&yes); err != nil || !yes {
		return false
	}
	f.seen.Store(true)
	return true
}

// isLockTimeout reports whether err is a statement's lock_timeout running
// out (SQLSTATE 55P03, lock_not_available).
func isLockTimeout(err error) bool { return sqlState(err) == "55P03" }
