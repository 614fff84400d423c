package postgres

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"time"
)

// maxPayloadLength bounds a NOTIFY payload (PostgreSQL refuses 8000 bytes
// or more). A longer election name is sent as an empty payload, which wakes
// every watcher of the store.
const maxPayloadLength = MaxNotifyPayloadLen

// statements are the store's SQL, with the table name filled in.
type statements struct {
	acquire, renewBatch, release, observe, request string
	// acquireLocking is acquire that waits for the row's lock even when
	// its snapshot shows the lease held by another token, and judges the
	// row as it stands once locked: the attempt of a candidate to which
	// a handover was prepared, and whose wait for it ended without the
	// grant (see LeaseStore.Acquire). acquire would refuse it from its
	// snapshot while the staged release that grants it waits to commit,
	// and nothing would tell it of that grant.
	acquireLocking string
	// grantReleased is the acquire statement of a candidate that a
	// release woke by name (see LeaseStore.Acquire), the successor of a
	// prepared handover among them: it grants only a released lease not
	// reserved for another candidate, and returns no row otherwise (then
	// the caller runs acquire).
	grantReleased string
	// grantNotice sends the NOTIFY of a grant if the grant still holds:
	// the acquire statement sends none (see LeaseStore.noticeGrantLater).
	grantNotice string
	// releaseQuiet is release without its NOTIFY, and without the
	// removal of the holder's entry among the candidates, which
	// dropHolder makes later; freedNotice sends that NOTIFY if the lease
	// is still free (a prepared handover's Commit whose successor waits:
	// see preparedHandover.Commit).
	releaseQuiet, freedNotice, dropHolder string
	// releaseGranting and claimStaged: a staged handover's release,
	// which grants the successor the lease, and the successor's claim of
	// it (see preparedHandover.Stage).
	releaseGranting, claimStaged string
}

// expiry returns the SQL expression for when the lease of row l runs out,
// with hb the quoted heartbeat table: its own expires_at, or, for a lease
// under a heartbeat, the heartbeat's expiry while it is not dead
// ('-infinity' once it is dead or gone).
func expiry(hb string) string {
	return fmt.Sprintf(`(CASE WHEN l.heartbeat IS NULL THEN l.expires_at
		ELSE coalesce((SELECT h.expires_at FROM %s AS h WHERE h.id = l.heartbeat AND NOT h.dead), '-infinity') END)`, hb)
}

// heldAt returns the SQL condition for a row of l that has a holder at
// now, with hb the quoted heartbeat table.
func heldAt(hb, now string) string {
	return fmt.Sprintf(`(l.holder_token IS NOT NULL AND %s > %s)`, expiry(hb), now)
}

// releasePayload and grantPayload are the SQL expressions for the NOTIFY
// payloads of a release and of a grant of row name (see parsePayload).
var (
	releasePayload = fmt.Sprintf(`CASE WHEN octet_length(name) > %d THEN ''
		WHEN left(name, 1) = '~' THEN '%s' || name ELSE name END`, maxPayloadLength-len(payloadRelease), payloadRelease)
	grantPayload = fmt.Sprintf(`CASE WHEN octet_length(name) > %d THEN '' ELSE '%s' || name END`,
		maxPayloadLength-len(payloadGrant), payloadGrant)
)

// freedPayload is the SQL expression for the NOTIFY payload of a release
// of row name that may have been handed over: a handover's (see
// parsePayload) while the row's reservation runs, and the release's
// otherwise. The columns name, successor_token and reserved_until must be
// in scope.
var freedPayload = fmt.Sprintf(`CASE WHEN successor_token IS NOT NULL AND reserved_until > clock_timestamp()
		AND octet_length(name) + octet_length(successor_token) <= %d
	THEN '%s' || (extract(epoch FROM reserved_until - clock_timestamp()) * 1000000)::bigint
		|| ',' || octet_length(successor_token) || ':' || successor_token || name
	ELSE %s END`, maxPayloadLength-32, payloadHandover, releasePayload)

// dibsPayload is the SQL expression for the NOTIFY payload of a release
// of row name: if the column dibs is true (see dibsCondition), a
// handover's to the candidate that the column first_token names (see
// firstCandidate) for dibsHold, which wakes it alone and the other
// candidates dibsHold (and deferSlack) later, unless a grant's notice
// comes first; otherwise a handover's (freedPayload) while the row's
// reservation runs, and the release's after it. The lease itself is not
// reserved: it is free for any candidate at once. The columns name,
// successor_token, reserved_until, first_token and dibs must be in
// scope.
var dibsPayload = fmt.Sprintf(`CASE WHEN dibs
	THEN '%s%d,' || octet_length(first_token) || ':' || first_token || name
	ELSE %s END`, payloadHandover, dibsHold/time.Microsecond, freedPayload)

// dibsCondition is the SQL condition for a release of row r whose notice
// names the candidate to wake first (dibsPayload): a plain release (not
// ReleaseTo, which reserves the lease), a candidate d.first_token was
// found, and the payload is not too long.
var dibsCondition = fmt.Sprintf(`r.successor_token IS NULL
		AND d.first_token IS NOT NULL AND octet_length(r.name) + octet_length(d.first_token) <= %d`, maxPayloadLength-32)

// candidateBuckets is how many candidate channels a channel has (see
// candidateChannel).
const candidateBuckets = 256

// maxCandidateChannel is the longest channel that has candidate
// channels: PostgreSQL's identifiers, channels among them, have 63 bytes
// at most, and a candidate channel is 3 bytes longer.
const maxCandidateChannel = 60

// candidateChannel returns the candidate channel of the candidate of
// token on channel: channel, "~", and the first two hexadecimal digits
// of the SHA-256 of token (as UTF-8), so one of candidateBuckets. A plain release's
// notice that names the candidate to wake first is sent there alone (see
// LeaseStore.Release), and a store's listener LISTENs on the candidate
// channels of its free-watchers' candidates, so that the release wakes
// the backends and processes of that candidate (and of the few that share
// its channel), not every listener's. It returns "" for a channel too
// long to have candidate channels (see maxCandidateChannel).
func candidateChannel(channel, token string) string {
	if len(channel) > maxCandidateChannel {
		return ""
	}
	sum := sha256.Sum256([]byte(token))
	return channel + "~" + hex.EncodeToString(sum[:1])
}

// candidateChannelSQL returns the SQL expression of candidateChannel for
// the channel that the parameter channel ("$4") holds and the token column
// first_token, when the column targeted is true, and of the channel
// otherwise.
func candidateChannelSQL(channel string) string {
	return `CASE WHEN targeted
	THEN ` + channel + `::text || '~' || left(encode(sha256(convert_to(first_token, 'UTF8')), 'hex'), 2) ELSE ` + channel + `::text END`
}

// firstCandidate returns the SQL query for the token of the candidate
// that a plain release of the lease named by the expression name, held
// by the token expression holder, wakes first (dibsPayload), as the column
// first_token: among the entries of table (the candidates' table) that
// have not run out, those of the highest priority; of these, the fresh
// ones (enlisted again within the last half of their entry's life: 1.5
// TTLs for an Elector's, which enlists at each attempt, at least once a
// TTL) before the others (a candidate killed, or one that no longer
// attempts); of these, the advisory candidates that made an attempt on
// their own session within the last 3/4 of sessionIdle (the column
// session_at, see upsertCandidate; NULL for the lease strategy's) first:
// an advisory candidate keeps its session at least sessionIdle after its
// last use, and one that only shared others' attempts (see
// AdvisoryStore.flight) has none, so it would open one before its attempt;
// and among equals the one that has campaigned the longest (the column
// since), as in a queue. No row if there is none. A campaign just begun
// (a process started, or an instance that ran again after its tenure) is
// named after those of the same rank that waited (an advisory candidate
// with a session still comes before one without): its process, its
// connections and its listener are the least likely to be ready, and one named that
// does not take the lease at once costs the handover the others' wait. A
// release removes the holder's own entry (see dropHolderCandidate), so
// that a leader that let go queues behind the candidates that waited; a
// prepared handover whose successor waits removes it at the end of its
// Commit, about 5 ms after the successor's grant (see
// dropReleasedHolder), and a release by the new leader within those 5 ms
// may name the old one. Ties (the entries of one statement) go by token.
func firstCandidate(table, name, holder string) string {
	return fmt.Sprintf(`SELECT c.token AS first_token FROM %s AS c
	WHERE c.name = %s AND c.token <> %s AND c.expires_at > clock_timestamp()
	ORDER BY c.priority DESC, clock_timestamp() - c.refreshed_at < (c.expires_at - c.refreshed_at) / 2 DESC,
		coalesce(c.session_at > clock_timestamp() - %d * interval '1 second', false) DESC, c.since, c.token
	LIMIT 1`, table, name, holder, int(sessionIdle/time.Second)*3/4)
}

// dropHolderCandidate returns the SQL of a CTE named dropped, for a release
// statement that has the CTE "released" (its released row, if any): it
// deletes the entry of the holder's token (the SQL expression holder)
// among the candidates of the released name, in table (the candidates'
// table). A leader that lets go and campaigns again enlists anew, behind
// the candidates that waited (see firstCandidate).
func dropHolderCandidate(table, holder string) string {
	return fmt.Sprintf(`dropped AS (
	DELETE FROM %s AS c USING released AS r WHERE c.name = r.name AND c.token = %s
)`, table, holder)
}

// dropReleasedHolder returns the statement that removes the holder's own
// entry among the candidates (table) after a prepared handover's release
// that left it (a statement of its own, after the successor's grant): $1
// name, $2 the holder's token. As a release's own removal (see
// dropHolderCandidate), but only if the row of name in leases (the
// strategy's table) was released after the entry was last enlisted (its
// released_at, which grants leave alone, after the entry's refreshed_at)
// and does not name the token as its holder: an entry that the holder
// enlisted again after the release stays, and so does one whose holder
// still holds the lease.
func dropReleasedHolder(table, leases string) string {
	return fmt.Sprintf(`DELETE FROM %s AS c
	WHERE c.name = $1 AND c.token = $2
		AND EXISTS (SELECT FROM %s AS l WHERE l.name = $1 AND l.released_at > c.refreshed_at
			AND l.holder_token IS DISTINCT FROM $2)`, table, leases)
}

func newStatements(opts Options) statements {
	table, hb, st := opts.qualifiedTable(), opts.qualifiedHeartbeatTable(), opts.qualifiedStrategyTable()
	// released is the CTE of the release statements that frees the
	// lease and records the reservation ($1 to $8, as for release).
	// releasedOnly is that CTE without the removal of the holder's entry
	// among the candidates (releaseQuiet).
	releasedOnly := fmt.Sprintf(`released AS (
	UPDATE %[1]s AS l
	SET (holder_token, holder_id, acquired_at, renewed_at, expires_at, heartbeat, released_at, %[3]s) = (
		NULL, '', NULL, NULL, NULL, NULL, c.now, NULL, NULL, NULL, $5, $6, $7, c.now + $8::interval)
	FROM clock_timestamp() AS c(now)
	WHERE l.name = $1 AND l.holder_token = $2 AND l.term = $3
		AND %[2]s > clock_timestamp()
	RETURNING l.name, l.successor_token, l.reserved_until
)`, table, expiry(hb), clearedTransfer)
	released := releasedOnly + ", " + dropHolderCandidate(opts.qualifiedCandidateTable(), "$2")
	// release is the release statement, whose NOTIFY is the expression
	// notify, and which says whether it was sent on a candidate channel
	// (the boolean expression targeted, where dibs is).
	release := func(notify, targeted string) string {
		return fmt.Sprintf(`
WITH %[1]s, notified AS (
	SELECT %[2]s AS sent, targeted FROM (
		SELECT r.name, r.successor_token, r.reserved_until, d.first_token, k.dibs,
			k.dibs AND %[5]s AS targeted
		FROM released AS r LEFT JOIN LATERAL (%[3]s) AS d ON true
		CROSS JOIN LATERAL (SELECT %[4]s AS dibs) AS k
	) AS x
)
SELECT count(*), coalesce(bool_or(targeted), false) FROM notified`, released, notify,
			firstCandidate(opts.qualifiedCandidateTable(), "r.name", "$2"), dibsCondition, targeted)
	}
	// strategyRow is the CTE "st" of the grant statements (see acquire's
	// comments below).
	strategyRow := fmt.Sprintf(`st AS MATERIALIZED (
	SELECT s.term_floor FROM %s AS s WHERE s.name = $1 AND s.strategy = 'lease' FOR KEY SHARE
)`, st)
	// The acquire statement: see the statements' comments below. $5, the
	// channel, is not used but for its type: a grant's NOTIFY is sent
	// noticeDelay later (noticeGrantLater).
	acquireSQL := func(heldFromSnapshot bool) string {
		return fmt.Sprintf(`
WITH %[7]s, %[8]s, reserved AS MATERIALIZED (
	SELECT l.term, %[9]s FROM %[1]s AS l WHERE l.name = $1 AND %[10]s
), held AS MATERIALIZED (
	SELECT l.term, l.holder_id, l.acquired_at, x.expires_at, x.expires_at - c.now AS remaining, %[9]s
	FROM %[1]s AS l, clock_timestamp() AS c(now), LATERAL (SELECT %[6]s AS expires_at) AS x
	WHERE %[22]t AND l.name = $1 AND l.holder_token <> $2 AND x.expires_at > c.now
), killed AS (
	UPDATE %[5]s AS h SET dead = true
	FROM %[1]s AS k
	WHERE k.name = $1 AND h.id = k.heartbeat AND h.expires_at <= clock_timestamp()
	RETURNING h.id
), granted AS (
	INSERT INTO %[1]s AS l (name, term, holder_token, holder_id, acquired_at, renewed_at, expires_at, priority, reason)
	SELECT $1, greatest(st.term_floor, ep.floor) + 1, $2, $3, c.now, c.now, c.now + $4::interval, $6, ''
	FROM clock_timestamp() AS c(now), st, ep
	WHERE ep.ok AND NOT EXISTS (SELECT FROM reserved) AND NOT EXISTS (SELECT FROM held)
	ON CONFLICT (name) DO UPDATE
	SET (term, holder_token, holder_id, acquired_at, renewed_at, expires_at, heartbeat, priority, reason, %[11]s) = (
		SELECT greatest(l.term, st.term_floor, ep.floor) + 1, excluded.holder_token, excluded.holder_id, c.now, c.now, c.now + $4::interval, NULL,
			excluded.priority, %[12]s, %[13]s
		FROM clock_timestamp() AS c(now), st, ep
	)
	WHERE (SELECT ep.ok FROM ep) AND NOT %[14]s AND (
		l.holder_token IS NULL
		OR l.holder_token = excluded.holder_token
		OR (l.heartbeat IS NULL AND l.expires_at <= clock_timestamp())
		OR l.heartbeat IN (SELECT id FROM killed))
	RETURNING l.name, l.term, l.holder_id, l.acquired_at, l.expires_at, %[9]s
), notified AS (
	SELECT %[2]s FROM granted
), durable AS (
	SELECT %[4]s FROM granted
), %[20]s, %[19]s, existing AS (
	SELECT l.term, l.holder_token, l.holder_id, l.acquired_at, %[6]s AS expires_at, %[9]s
	FROM %[1]s AS l
	WHERE l.name = $1 AND NOT EXISTS (SELECT FROM reserved) AND NOT EXISTS (SELECT FROM held)
	FOR UPDATE OF l
)
SELECT true, g.term, true, g.holder_id, g.acquired_at, g.expires_at,
	g.expires_at - clock_timestamp(), (SELECT count(*) FROM notified) + (SELECT count(*) FROM durable) + (SELECT count(*) FROM fenced),
	true, %[15]s
FROM granted AS g
UNION ALL
SELECT false, l.term, %[3]s, l.holder_id, l.acquired_at, nullif(l.expires_at, '-infinity'),
	CASE WHEN %[3]s THEN l.expires_at - c.now ELSE interval '0' END, 0, EXISTS (SELECT FROM st), %[16]s
FROM existing AS l, clock_timestamp() AS c(now)
WHERE NOT EXISTS (SELECT FROM granted)
UNION ALL
SELECT false, 0::bigint, false, '', NULL::timestamptz, NULL::timestamptz, interval '0', 0, false, %[17]s
WHERE NOT EXISTS (SELECT FROM st) AND NOT EXISTS (SELECT FROM %[1]s AS l WHERE l.name = $1)
UNION ALL
SELECT false, r.term, false, '', NULL::timestamptz, NULL::timestamptz, interval '0', 0, EXISTS (SELECT FROM st), %[18]s
FROM reserved AS r
UNION ALL
SELECT false, h.term, true, h.holder_id, h.acquired_at, h.expires_at, h.remaining, 0, EXISTS (SELECT FROM st), %[21]s
FROM held AS h`,
			table, `$5::text`, `(l.holder_token IS NOT NULL AND l.expires_at > c.now)`, durableCommit, hb, expiry(hb), strategyRow,
			epochCTEs(opts.qualifiedEpochTable(), "$4::interval"),
			transferColumns("l"), reservedForOther("l", "$2"), clearedTransfer,
			grantReasonSQL("l", "excluded.holder_token", "("+expiry(hb)+" > c.now)"), clearedValues,
			reservedForOther("l", "excluded.holder_token"), transferNames("g"), transferNames("l"), noTransfer, transferNames("r"),
			enlistCTEs(opts.qualifiedCandidateTable(), "EXISTS (SELECT FROM st)", "$4::interval", [4]string{"$1", "$2", "$3", "$6"}, false),
			fenceAfterGrant(opts), transferNames("h"), heldFromSnapshot)
	}
	acquire, acquireLocking := acquireSQL(true), acquireSQL(false)
	// The statement of a released lease's grant: see the statements'
	// comments below.
	grantReleased := fmt.Sprintf(`
WITH %[2]s, %[3]s, granted AS (
	UPDATE %[1]s AS l
	SET (term, holder_token, holder_id, acquired_at, renewed_at, expires_at, heartbeat, priority, reason, %[4]s) = (
		greatest(l.term, st.term_floor, ep.floor) + 1, $2, $3, c.now, c.now, c.now + $4::interval, NULL,
		$6, %[9]s, %[5]s)
	FROM clock_timestamp() AS c(now), st, ep
	WHERE l.name = $1 AND ep.ok AND l.holder_token IS NULL AND NOT %[10]s
	RETURNING l.term, l.holder_id, l.acquired_at, l.expires_at, %[6]s
), notified AS (
	SELECT $5::text FROM granted
), durable AS (
	SELECT %[7]s FROM granted
), %[11]s
SELECT true, g.term, true, g.holder_id, g.acquired_at, g.expires_at,
	g.expires_at - clock_timestamp(), (SELECT count(*) FROM notified) + (SELECT count(*) FROM durable) + (SELECT count(*) FROM fenced),
	true, %[8]s
FROM granted AS g`, table, strategyRow, epochCTEs(opts.qualifiedEpochTable(), "$4::interval"), clearedTransfer, clearedValues,
		transferColumns("l"), durableCommit, transferNames("g"), grantReasonSQL("l", "$2", "false"), reservedForOther("l", "$2"),
		fenceAfterGrant(opts))
	// The staged release that grants: see the statements' comments below.
	releaseGranting := fmt.Sprintf(`
WITH %[2]s, %[3]s, granted AS (
	UPDATE %[1]s AS l
	SET (term, holder_token, holder_id, acquired_at, renewed_at, expires_at, heartbeat, released_at, priority, reason, %[4]s) = (
		greatest(l.term, st.term_floor, ep.floor) + 1, $4, $5, c.now, c.now,
		c.now + $8::interval, NULL, c.now,
		$7, $6, %[5]s)
	FROM clock_timestamp() AS c(now), st, ep
	WHERE l.name = $1 AND l.holder_token = $2 AND l.term = $3 AND ep.ok
		AND %[6]s > c.now
	RETURNING l.name
), durable AS (
	SELECT %[7]s FROM granted
)
SELECT (SELECT count(*) FROM granted), (SELECT count(*) FROM durable)`, table,
		strategyRow, epochCTEs(opts.qualifiedEpochTable(), "$8::interval"),
		clearedTransfer, clearedValues, expiry(hb), durableCommit)
	return statements{
		// Staged release that grants (see preparedHandover.Stage): $1
		// name, $2 the holder's token, $3 its term, $4 the successor's
		// token, $5 its candidate ID, $6 the handover's reason, $7 its
		// priority, $8 the TTL of the heartbeat the lease is under. In one update, it ends the holder's term and grants
		// the successor the lease: the next term (above the strategy
		// row's term_floor and the epoch's floor, as every grant's), the
		// successor's token and ID, acquired now, its priority, the
		// handover's reason, no request and no reservation (the lease is
		// held: nobody else is granted it), and the holder's TTL ($8; the
		// successor's first renewal puts its own), on no heartbeat. Only an unexpired lease
		// held by the token under the term, of a name that the strategy
		// row gives the lease strategy, outside a failover's grace. It
		// runs in a transaction that Commit makes visible, after
		// OnDemoted; the successor's waiting statement then only reads
		// the row (claimStaged). Committed durably (durableCommit).
		// Returns the count of leases granted (1 or 0), and 1 if durable.
		releaseGranting: releaseGranting,

		// Claim of a staged grant: $1 name, $2 token, $3 ttl. The
		// successor's statement once it has the handover's lock (see
		// acquireWaiting): if the row names this token as its holder,
		// unexpired and on no heartbeat, a staged release granted it the
		// lease (a candidate that waits is not the holder); it returns
		// acquire's first branch's row for it, read, not written. No
		// row otherwise, nor when the grant's TTL (the old holder's) is
		// shorter than ttl, on which the successor's Elector counts: the
		// caller then runs grantReleased, and then acquire, which grants
		// it again for ttl.
		claimStaged: fmt.Sprintf(`
SELECT true, l.term, true, l.holder_id, l.acquired_at, l.expires_at,
	l.expires_at - clock_timestamp(), 0::bigint, true, %[2]s
FROM %[1]s AS l
WHERE l.name = $1 AND l.holder_token = $2 AND l.heartbeat IS NULL AND l.expires_at > clock_timestamp()
	AND l.expires_at - l.acquired_at >= $3::interval`,
			table, transferColumns("l")),

		// Acquire: $1 name, $2 token, $3 candidate ID, $4 ttl, $5 channel,
		// $6 priority.
		//
		// "granted" inserts the row or takes it over where it is free,
		// held by the same token, or expired: its own expiry passed, or
		// the heartbeat it is under was found expired by "killed", which
		// marks that heartbeat dead in the same statement so that it can
		// never be renewed again (see "Heartbeats" in the package
		// documentation). ON CONFLICT locks the row and judges it as it
		// stands after any concurrent transaction committed; "killed"
		// judges the heartbeat the same way, as an UPDATE. A grant's
		// lease is under no heartbeat; it records the candidate's
		// priority and why it was granted (grantReasonSQL), and clears any
		// request and reservation. "notified" sends the wake-up for a
		// grant, and "durable" makes its commit durable (durableCommit).
		// When nothing was granted and neither "reserved" nor "held"
		// (below) found the row, "existing" reports the row, locked FOR
		// UPDATE so that it too is the row as it stands and not as it was
		// when the statement began. ("existing" is read only in that case:
		// the second branch runs only if "granted" is empty.) Its
		// heartbeat is read as the statement's snapshot has it, without a
		// lock: every statement locks a heartbeat before a lease row, never
		// after, so that none of them deadlock. A renewal of it that
		// committed meanwhile is then not seen, and the lease may be
		// reported free when it is not, which costs the caller one more
		// attempt but grants it nothing.
		//
		// A released lease reserved for another candidate's token (see
		// ReleaseTo) is not free. "reserved" finds it so in the
		// statement's snapshot: then the statement neither tries to
		// insert nor locks the row, and reports the reservation from the
		// snapshot (the fourth branch), so that the candidates a handover
		// wakes besides the successor never hold up its grant on the
		// row's lock. A reservation committed after the snapshot is
		// judged by ON CONFLICT, on the row as it stands.
		//
		// Likewise a lease that another token holds, unexpired, in the
		// statement's snapshot is not free: "held" finds it so (its
		// expiry and what is left of it on one reading of the clock, so
		// that it is never reported free for having run out during the
		// statement), and then
		// the statement neither inserts nor locks the row, and reports
		// the holder from the snapshot (the fifth branch). So an attempt
		// never waits for the row lock of a renewal or of a staged
		// release (preparedHandover.Stage) in flight, to run beside the
		// successor once the same commit lets them both go. A release
		// committed after the snapshot is then reported as still held;
		// its notice, sent at or after that commit, wakes the caller
		// (Elector.Run watches before its first attempt), which costs it
		// one more attempt, and a grant committed after the snapshot is
		// reported as its predecessor's until the caller's next attempt,
		// as for a grant made just after the statement. That holds for a
		// staged release's grant to the caller too, which no notice tells
		// it of: a candidate to which a handover was prepared runs
		// acquireLocking instead, which has no "held" (see statements).
		// Without wake-ups (a transaction pooler, a failed Watch) a
		// caller whose attempt overlapped a release waits for the expiry
		// it was told, as every follower then does.
		//
		// "st" locks the name's row of the strategy table (FOR KEY SHARE,
		// which only a claim's FOR UPDATE waits for) if it names the lease
		// strategy; only then is anything granted, with a term above the
		// row's term_floor. The column "mine" says whether it did:
		// when it is false the caller claims the name (claimStrategy) and
		// tries again. The third branch answers for a name with no row in
		// either table. "ep" and "seen" hold off every grant, a re-grant
		// too, for a TTL after a failover, and lift its term above the
		// earlier timelines' (see epochCTEs). The last columns are the
		// transfer columns (transferColumns).
		//
		// When nothing was granted and "st" found the name the lease
		// strategy's, "enlisting" and "enlisted" enlist the candidate
		// for EnlistFactor times the TTL, whatever refused it (see
		// enlistCTEs); a grant writes no entry.
		acquire: acquire,

		// The acquire statement without "held": see statements.
		acquireLocking: acquireLocking,

		// Grant of a released lease: the parameters of acquire. It
		// grants what acquire grants to a candidate when the lease is
		// released and not reserved for another candidate, on the same
		// terms ("st" and "ep" hold it off as there, the term is above
		// the floors, the reason is the reservation's or 'release', and
		// "durable" makes the commit durable), and nothing else: it
		// neither inserts, nor judges an expiry or a heartbeat, nor
		// enlists, nor reports a lease it did not grant. A candidate that
		// a release woke by name, as the one to wake first or its
		// successor, finds the lease so in all but a few handovers
		// (another candidate was faster, a prepared handover was
		// aborted, a failover's hold), and the statement then returns no
		// row: the caller runs acquire. Its row is acquire's first
		// branch's.
		grantReleased: grantReleased,

		// Renew, for a batch: $1 names, $2 tokens, $3 terms, $4 TTLs in
		// microseconds, one element per lease. Renews each unexpired
		// lease held by its token under its term, on one reading of the
		// server's clock, on its own expiry (taking it out from under a
		// heartbeat); never inserts. Returns the leases renewed, with
		// their transfer columns (a pending request is what the holder
		// reads there). "durable" (one row) makes the commit durable
		// (durableCommit).
		renewBatch: fmt.Sprintf(`
WITH durable AS (
	SELECT %[2]s
)
UPDATE %[1]s AS l
SET (renewed_at, expires_at, heartbeat) = (c.now, c.now + r.ttl_us * interval '1 microsecond', NULL)
FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bigint[]) AS r(name, token, term, ttl_us),
	clock_timestamp() AS c(now), durable
WHERE l.name = r.name AND l.holder_token = r.token AND l.term = r.term
	AND %[3]s > c.now
RETURNING l.name, l.holder_token, l.term, l.holder_id, l.acquired_at, l.expires_at, l.expires_at - clock_timestamp(), %[4]s`,
			table, durableCommit, expiry(hb), transferColumns("l")),

		// Release: $1 name, $2 token, $3 term, $4 channel, and, for a
		// handover (ReleaseTo), $5 the successor's token, $6 its
		// candidate ID, $7 the reason of its grant, $8 how long the lease
		// is reserved for it (all NULL for a plain release). Frees an
		// unexpired lease held by the token under the term, keeping the
		// term and clearing any request, records the reservation (none
		// for a plain release), and sends the wake-up in the same
		// statement (it is delivered when the statement commits). The
		// notice of a release that names the candidate to wake first
		// goes to that candidate's channel alone (see candidateChannel),
		// if $4 is short enough to have candidate channels; Release then
		// sends the plain release's to $4 later, if the lease is still
		// free. Returns 1 if released, and whether the notice went to a
		// candidate channel.
		release: release(`pg_notify(`+candidateChannelSQL("$4")+`, `+dibsPayload+`)`,
			fmt.Sprintf("octet_length($4::text) <= %d", maxCandidateChannel)),

		// releaseQuiet is release without a NOTIFY: $4 is not used but
		// for its type. It does not look for the candidate to wake first
		// either (firstCandidate), which only a notice names, nor remove
		// the holder's own entry among the candidates (dropHolder does,
		// after the notice), so that a prepared handover's commit, which
		// its successor waits for, is as short as it can be.
		releaseQuiet: `
WITH ` + releasedOnly + `, notified AS (
	SELECT $4::text AS sent FROM released
)
SELECT count(*), false FROM notified`,

		// The NOTIFY of a release, if the lease is still free: $1 name,
		// $2 channel. "free" locks the row, so that a grant under way
		// is waited for and then seen, and no notice of the release
		// can follow the grant's. Returns a row if it sent one.
		freedNotice: fmt.Sprintf(`
WITH free AS MATERIALIZED (
	SELECT name, successor_token, reserved_until FROM %[1]s WHERE name = $1 AND holder_token IS NULL FOR UPDATE
)
SELECT pg_notify($2, %[2]s) FROM free`, table, freedPayload),

		// The removal of the holder's own entry among the candidates
		// after a quiet release (releaseQuiet): see dropReleasedHolder.
		dropHolder: dropReleasedHolder(opts.qualifiedCandidateTable(), table),

		// The NOTIFY of a grant, if the lease is still held by it: $1
		// name, $2 the holder's token, $3 its term, $4 channel. "held"
		// locks the row (FOR SHARE), so that a release under way is
		// waited for and then seen, and no notice of the grant can follow
		// the release's. Returns a row if it sent one.
		grantNotice: fmt.Sprintf(`
WITH held AS MATERIALIZED (
	SELECT name FROM %[1]s WHERE name = $1 AND holder_token = $2 AND term = $3 FOR SHARE
)
SELECT pg_notify($4, %[2]s) FROM held`, table, grantPayload),

		// Observe: $1 name.
		observe: fmt.Sprintf(`
SELECT l.term, %[2]s, l.holder_id, l.acquired_at, nullif(%[3]s, '-infinity'),
	CASE WHEN %[2]s THEN %[3]s - c.now ELSE interval '0' END, %[4]s
FROM %[1]s AS l, clock_timestamp() AS c(now)
WHERE l.name = $1`, table, heldAt(hb, "c.now"), expiry(hb), transferColumns("l")),

		// Request, RequestTransfer's: $1 name, $2 the candidate ID asked
		// for, $3 the reason, $4 how long it stays pending (NULL clears
		// it). Records the request on a lease held, on the server's
		// clock, and returns the lease as Observe does; no row if the
		// lease is not held.
		request: fmt.Sprintf(`
UPDATE %[1]s AS l
SET (request_to, request_reason, request_until) = ($2, $3, c.now + $4::interval)
FROM clock_timestamp() AS c(now)
WHERE l.name = $1 AND %[2]s
RETURNING l.term, true, l.holder_id, l.acquired_at, %[3]s, %[3]s - clock_timestamp(), %[4]s`,
			table, heldAt(hb, "c.now"), expiry(hb), transferColumns("l")),
	}
}
