package postgres

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
)

// Transfers (leader.Transferer), what both strategies share: the
// candidates' table, and how a statement reports a lease's transfer
// columns (migration 009). See "Transfers" in the package documentation.

// transferRow is what a statement reports of a lease row's transfer
// columns: the holder's priority and the reason of the last grant, the
// pending request (with how long it has left, on the server's clock), and
// the reservation (likewise). A request or a reservation whose time has
// run out, or that the lease's state makes moot, is not reported. Every
// column may be NULL (a lease that a statement did not find).
type transferRow struct {
	priority     *int32
	reason       *string
	requestTo    *string
	requestWhy   *string
	requestLeft  *time.Duration
	successorID  *string
	reservedLeft *time.Duration
}

// transferColumns is the SQL select list of a lease row a's transfer
// columns, named as transferNames names them, in the order
// transferRow.dest scans them.
func transferColumns(a string) string {
	return fmt.Sprintf(`%[1]s.priority, %[1]s.reason, %[1]s.request_to, %[1]s.request_reason,
	%[1]s.request_until - clock_timestamp() AS request_left, %[1]s.successor_id,
	%[1]s.reserved_until - clock_timestamp() AS reserved_left`, a)
}

// transferNames is the SQL select list of the columns of transferColumns,
// as the rows of a CTE or subquery a that selected them.
func transferNames(a string) string {
	return fmt.Sprintf(`%[1]s.priority, %[1]s.reason, %[1]s.request_to, %[1]s.request_reason, %[1]s.request_left,
	%[1]s.successor_id, %[1]s.reserved_left`, a)
}

// noTransfer is the SQL select list of transferColumns for a lease that
// has no row.
const noTransfer = `0, '', NULL::text, NULL::text, NULL::interval, NULL::text, NULL::interval`

// dest returns the scan targets of the columns of transferColumns.
func (r *transferRow) dest() []any {
	return []any{&r.priority, &r.reason, &r.requestTo, &r.requestWhy, &r.requestLeft, &r.successorID, &r.reservedLeft}
}

// request returns the pending request that r reports, or none (its
// Remaining zero).
func (r transferRow) request() leader.TransferRequest {
	if r.requestLeft == nil || *r.requestLeft <= 0 {
		return leader.TransferRequest{}
	}
	return leader.TransferRequest{To: deref(r.requestTo), Reason: leader.GrantReason(deref(r.requestWhy)), Remaining: *r.requestLeft}
}

// holderPriority returns the holder's priority that r reports.
func (r transferRow) holderPriority() int {
	if r.priority == nil {
		return 0
	}
	return int(*r.priority)
}

// grantReason returns the reason of the grant that r reports.
func (r transferRow) grantReason() leader.GrantReason {
	return leader.GrantReason(deref(r.reason))
}

// apply reports r in l, whose holder and Remaining are set: the priority
// and a pending request of a lease held, the reservation of one that is
// not.
func (r transferRow) apply(l *leader.Lease) {
	l.Reason = r.grantReason()
	if l.Held() {
		l.Priority = r.holderPriority()
		l.Transfer = r.request()
		return
	}
	if r.successorID != nil && r.reservedLeft != nil && *r.reservedLeft > 0 {
		l.Successor, l.Reserved = *r.successorID, *r.reservedLeft
	}
}

// reservedForOther returns the SQL condition that the released lease of
// row a is reserved, at the server's now, for a token other than the one
// in token (an SQL expression); false (not NULL) when it is not reserved.
// A row whose holder is its successor (an advisory handover's release
// granted the successor the lease, see advisoryStatements.releaseGranting)
// counts as released until its reservation ends: the successor may not
// hold the lock yet.
func reservedForOther(a, token string) string {
	return fmt.Sprintf(`coalesce((%[1]s.holder_token IS NULL OR %[1]s.holder_token = %[1]s.successor_token)
		AND %[1]s.reserved_until > clock_timestamp() AND %[1]s.successor_token <> %[2]s, false)`, a, token)
}

// grantReasonSQL returns the SQL expression of why a grant to the token in
// token (an SQL expression) is made, from the lease row a as it stood
// before the grant, where held is the SQL condition that a was held then:
// the reservation's reason for its successor (also where the row already
// names it, granted by an advisory handover's release whose grant it
// could not claim), 'release' for a released
// lease, the empty reason for the holder while it held it, and 'expiry'
// otherwise (its holder went without a release).
func grantReasonSQL(a, token, held string) string {
	return fmt.Sprintf(`CASE
			WHEN (%[1]s.holder_token IS NULL OR %[1]s.holder_token = %[2]s) AND %[1]s.successor_token = %[2]s AND %[1]s.reserved_until > clock_timestamp() THEN %[1]s.successor_reason
			WHEN %[1]s.holder_token IS NULL THEN 'release'
			WHEN %[1]s.holder_token = %[2]s AND %[3]s THEN ''
			ELSE 'expiry'
		END`, a, token, held)
}

// clearedTransfer is the SQL list of the transfer columns that a grant or
// a release clears, and clearedValues their values: no request, no
// reservation.
const (
	clearedTransfer = `request_to, request_reason, request_until, successor_token, successor_id, successor_reason, reserved_until`
	clearedValues   = `NULL::text, NULL::text, NULL::timestamptz, NULL::text, NULL::text, NULL::text, NULL::timestamptz`
)

// upsertCandidate returns the SQL statement that enlists the candidates
// that query (an SQL query) selects, each as the columns name, token, id,
// priority, expires_at and session_at of the candidates' table: an upsert, which
// replaces the entry of a token enlisted already. A new entry campaigns
// since the statement's start (the columns since and refreshed_at
// default to it); an entry enlisted again is refreshed then, and keeps its
// since, unless it had run out, which counts as a break (see
// firstCandidate).
//
// The query's sixth column is the entry's session_at: the server's now if
// an advisory candidate enlists through an attempt on its own session,
// NULL otherwise (Enlist, the advisory candidates that shared another's
// attempt, and every lease candidate), which keeps the last one.
func upsertCandidate(table, query string) string {
	return fmt.Sprintf(`INSERT INTO %s AS c (name, token, id, priority, expires_at, session_at)
	%s
	ON CONFLICT (name, token) DO UPDATE SET (id, priority, expires_at, refreshed_at, since, session_at) = (excluded.id, excluded.priority, excluded.expires_at,
		excluded.refreshed_at, CASE WHEN c.expires_at <= clock_timestamp() THEN excluded.since ELSE c.since END,
		coalesce(excluded.session_at, c.session_at))`, table, query)
}

// claimedFor returns the SQL condition that the strategy table gives the
// name in name (an SQL expression) to the strategy in strategy (likewise).
func claimedFor(strategies, name, strategy string) string {
	return fmt.Sprintf(`EXISTS (SELECT FROM %s AS s WHERE s.name = %s AND s.strategy = %s)`, strategies, name, strategy)
}

// An Acquire that does not grant enlists its candidate (see
// leader.Transferer), in its own statement: the CTEs of enlistCTEs, or,
// for advisory candidates refused by a shared attempt, the statement
// enlistShared. It enlists as Enlist does, for leader.EnlistFactor times
// the TTL asked for, but only for a name that the strategy table gives to
// the Acquire's strategy, which is stricter than Enlist (that also
// enlists for a name that no strategy has claimed yet): an Acquire claims
// such a name and tries again, so its first statement does not enlist a
// candidate that its second grants.
//
// Its transaction commits with synchronous_commit off (lazyCommit): an
// entry that a crash loses is written again by the candidate's next
// attempt, and a refused statement writes nothing else that must survive
// a crash (row locks, and, lease strategy, a dead mark on an expired
// heartbeat whose lease it did not take, which no renewal would extend
// anyway), so a refusal does not wait for a WAL flush, which the refused
// candidates woken with the winner would otherwise add to the winner's.
const lazyCommit = `set_config('synchronous_commit', 'off', true)`

// enlistCTEs returns the SQL of the CTEs "enlisting" and "enlisted" of a
// grant statement, which has the CTE "granted" (a grant's row) before
// them: when nothing was granted and allowed (an SQL condition, see
// claimedFor) holds, they enlist the candidate whose name, token, ID and
// priority are the SQL expressions in cand, until leader.EnlistFactor
// times ttl (an SQL interval) from the server's now, and make the
// statement's commit lazy (lazyCommit). A grant writes nothing there.
//
// session says whether the statement runs on the candidate's own session
// (the advisory strategy's), which the entry then records (session_at,
// see upsertCandidate); the lease strategy has no sessions, and records
// none.
func enlistCTEs(table, allowed, ttl string, cand [4]string, session bool) string {
	sessionAt := "NULL::timestamptz"
	if session {
		sessionAt = "clock_timestamp()"
	}
	return fmt.Sprintf(`enlisting AS (
	SELECT %[3]s WHERE NOT EXISTS (SELECT FROM granted) AND %[2]s
), enlisted AS (
	%[1]s
)`, upsertCandidate(table, fmt.Sprintf(`SELECT %s, %s, %s, %s, clock_timestamp() + %s * %d, %s FROM enlisting`,
		cand[0], cand[1], cand[2], cand[3], ttl, leader.EnlistFactor, sessionAt)), allowed, lazyCommit)
}

// candidateStatements are the statements on the candidates' table.
type candidateStatements struct {
	// enlist: $1 name, $2 token, $3 candidate ID, $4 priority, $5 ttl,
	// $6 the store's strategy. One upsert: the entry of the token, until
	// ttl from the server's now; none while the strategy table gives the
	// name to the other strategy (whose leader could otherwise pick, as
	// its successor, a candidate that cannot take its lease). Returns a
	// row if it enlisted.
	enlist string
	// enlistShared, the entries of candidates that Acquire refused
	// without a statement of their own (advisory strategy: see
	// AdvisoryStore.enlistJoiners): $1 name, $2 tokens, $3 candidate IDs,
	// $4 priorities, $5 TTLs in microseconds (one element per
	// candidate, the tokens distinct), $6 the store's strategy. One
	// upsert, as an Acquire's statement enlists (see enlistCTEs).
	enlistShared string
	// withdraw: $1 name, $2 token. Deletes the entry of the token, and
	// the name's entries that have run out (of candidates that stopped
	// without withdrawing), so that the table keeps to the candidates
	// that campaign.
	withdraw string
	// list: $1 name. The name's entries that have not run out.
	list string
}

func newCandidateStatements(opts Options) candidateStatements {
	t, st := opts.qualifiedCandidateTable(), opts.qualifiedStrategyTable()
	return candidateStatements{
		enlist: "\n" + upsertCandidate(t, `SELECT $1, $2, $3, $4, clock_timestamp() + $5::interval, NULL::timestamptz
	WHERE NOT EXISTS (SELECT FROM `+st+` AS s WHERE s.name = $1 AND s.strategy <> $6)`) + `
RETURNING true`,
		enlistShared: fmt.Sprintf(`
WITH enlisting AS (
	SELECT j.*, %[2]s FROM unnest($2::text[], $3::text[], $4::int[], $5::bigint[]) AS j(token, id, priority, ttl_us)
	WHERE %[1]s
)
%[3]s`, claimedFor(st, "$1", "$6"), lazyCommit, upsertCandidate(t, fmt.Sprintf(
			`SELECT $1, j.token, j.id, j.priority, clock_timestamp() + j.ttl_us * %d * interval '1 microsecond', NULL::timestamptz FROM enlisting AS j`,
			leader.EnlistFactor))),
		withdraw: fmt.Sprintf(`
DELETE FROM %[1]s AS c WHERE c.name = $1 AND (c.token = $2 OR c.expires_at <= clock_timestamp())`, t),
		list: fmt.Sprintf(`
SELECT c.id, c.token, c.priority FROM %[1]s AS c WHERE c.name = $1 AND c.expires_at > clock_timestamp()`, t),
	}
}

// candidates is what both stores keep to serve Enlist, Withdraw and
// Candidates: their own pool, their strategy and the statements.
type candidates struct {
	pool     *pgxpool.Pool
	opts     Options
	strategy Strategy
	sql      candidateStatements
}

// newCandidates returns the candidates of the stores of strategy on pool.
func newCandidates(pool *pgxpool.Pool, opts Options, strategy Strategy) candidates {
	return candidates{pool: pool, opts: opts, strategy: strategy, sql: newCandidateStatements(opts)}
}

// Enlist implements leader.Transferer: one statement, an upsert of c's
// entry in the candidates' table, until ttl from the server's now. It
// refuses, with an error, while the strategy table gives name to the other
// strategy: a candidate of this store could not take a lease of that one
// (see One strategy per name in the package documentation); the store's
// Acquire then says so too, or claims the name.
func (cs candidates) Enlist(ctx context.Context, name string, c leader.Candidate, ttl time.Duration) error {
	ctx, cancel := cs.opts.bound(ctx)
	defer cancel()
	const op = "enlist"
	if err := checkTTL(op, name, ttl); err != nil {
		return err
	}
	if err := checkPriority(op, name, c); err != nil {
		return err
	}
	var enlisted bool
	err := cs.pool.QueryRow(ctx, cs.sql.enlist, name, c.Token, c.ID, int32(c.Priority), interval(ttl), string(cs.strategy)).Scan(&enlisted)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("postgres: %s %q: the name is elected with the %s strategy, and this candidate uses the %s strategy",
			op, name, cs.strategy.other(), cs.strategy)
	case err != nil:
		return wrapError(ctx, call(op, name), err)
	}
	return nil
}

// enlistment is a candidate that a refused Acquire enlists, with the TTL
// that the Acquire asked for.
type enlistment struct {
	c   leader.Candidate
	ttl time.Duration
}

// enlistShared enlists the candidates of name in es (by token), in one
// statement, as a refused Acquire's statement enlists its candidate (see
// enlistCTEs).
func (cs candidates) enlistShared(ctx context.Context, name string, es map[string]enlistment) error {
	tokens := slices.Sorted(maps.Keys(es)) // in one order, so that two statements of the same tokens never deadlock
	ids, priorities, ttls := make([]string, len(tokens)), make([]int32, len(tokens)), make([]int64, len(tokens))
	for i, token := range tokens {
		e := es[token]
		ids[i], priorities[i], ttls[i] = e.c.ID, int32(e.c.Priority), int64(interval(e.ttl)/time.Microsecond)
	}
	if _, err := cs.pool.Exec(ctx, cs.sql.enlistShared, name, tokens, ids, priorities, ttls, string(cs.strategy)); err != nil {
		return wrapError(ctx, call("enlist the candidates of", name), err)
	}
	return nil
}

// Withdraw implements leader.Transferer. It also deletes the entries of
// name that have run out.
func (cs candidates) Withdraw(ctx context.Context, name, token string) error {
	ctx, cancel := cs.opts.bound(ctx)
	defer cancel()
	if _, err := cs.pool.Exec(ctx, cs.sql.withdraw, name, token); err != nil {
		return wrapError(ctx, call("withdraw", name), err)
	}
	return nil
}

// Candidates implements leader.Transferer: the entries of name that have
// not run out, on the server's clock.
func (cs candidates) Candidates(ctx context.Context, name string) ([]leader.Candidate, error) {
	ctx, cancel := cs.opts.bound(ctx)
	defer cancel()
	rows, err := cs.pool.Query(ctx, cs.sql.list, name)
	if err != nil {
		return nil, wrapError(ctx, call("list the candidates of", name), err)
	}
	var (
		c        leader.Candidate
		priority int32
		out      []leader.Candidate
	)
	_, err = pgx.ForEachRow(rows, []any{&c.ID, &c.Token, &priority}, func() error {
		c.Priority = int(priority)
		out = append(out, c)
		return nil
	})
	if err != nil {
		return nil, wrapError(ctx, call("list the candidates of", name), err)
	}
	return out, nil
}

// checkPriority refuses a priority outside the 32 bits that the tables
// keep (leader.MinPriority to leader.MaxPriority, as Config checks).
func checkPriority(op, name string, c leader.Candidate) error {
	if c.Priority < math.MinInt32 || c.Priority > math.MaxInt32 {
		return fmt.Errorf("postgres: %s %q: priority %d of %s is outside %d..%d", op, name, c.Priority, c.ID, leader.MinPriority, leader.MaxPriority)
	}
	return nil
}

// checkHandover refuses a handover that no store could make: to no
// token, for no time, for a reason that is not a handover's, or with a
// term no grant has.
func checkHandover(name string, term uint64, successor leader.Candidate, reason leader.GrantReason, hold time.Duration) error {
	switch {
	case term > math.MaxInt64:
		return fmt.Errorf("postgres: release %q term %d to %s: %w", name, term, successor.ID, leader.ErrLeaseLost)
	case successor.Token == "":
		return fmt.Errorf("postgres: release %q term %d to %s: the successor has no token", name, term, successor.ID)
	case hold <= 0:
		return fmt.Errorf("postgres: release %q term %d to %s: hold must be positive, is %v", name, term, successor.ID, hold)
	case reason != leader.GrantTransfer && reason != leader.GrantPriority:
		return fmt.Errorf("postgres: release %q term %d to %s: reason %q is not %q or %q", name, term, successor.ID, reason, leader.GrantTransfer, leader.GrantPriority)
	}
	return nil
}

// requestArgs returns the request's columns as statement arguments: the
// candidate ID, the reason, and how long it stays pending (NULL, which
// clears it, for a ttl that is not positive).
func requestArgs(req leader.TransferRequest, ttl time.Duration) (to, why string, pending *time.Duration) {
	if ttl > 0 {
		iv := interval(ttl)
		pending = &iv
	}
	return req.To, string(req.Reason), pending
}

// noLeader is RequestTransfer's error when the lease is not held.
func noLeader(name string) error {
	return fmt.Errorf("postgres: request transfer %q: %w", name, leader.ErrNoLeader)
}
