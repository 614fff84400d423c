package postgres

import (
	"strconv"
	"strings"
)

// advisoryStatements are the advisory strategy's SQL, with the table name
// filled in. Every statement names the lock by key and, where it reads
// pg_locks, by the key's two halves: PostgreSQL shows a bigint advisory
// key's high 32 bits as classid and its low 32 bits as objid (both of type
// oid, so unsigned), with objsubid 1. Comparing the halves as bigints is
// what makes ownership checks right for every key, negative ones and those
// at and above 2^32 included.
type advisoryStatements struct {
	grant, grantQuick, grantLocked, announce, queue, regrant, renew, release, releaseNotice, announcedReleaseNotice, unlock, unlockRest, observe, waiter, reserved, heldHere, request string
	// namedUnlock and namedMark: see namedUnlock and namedMark.
	namedUnlock, namedMark string
	// unlockHandedOver: see unlockHandedOver. releaseHandedOver,
	// releaseGranting, claimLock, claimRow and dropHolder: see
	// newAdvisoryStatements.
	unlockHandedOver, releaseHandedOver, releaseGranting, releaseGrantingStaged, claimLock, claimRow, dropHolder string
}

// unlockHandedOver is the second statement of a prepared handover's
// release whose successor waits (see releaseOn): $1 the lease's key, $2
// and $3 the handover lock's two int4 keys. It unlocks the lease's lock,
// then the handover's, on which the successor's statement waits, in this
// order, and returns whether it unlocked the lease's lock, and 1. It is
// on the handover's path, so it is prepared and planned ahead like the
// release statement (see planAhead).
const unlockHandedOver = `WITH lease AS MATERIALIZED (
	SELECT pg_advisory_unlock($1::bigint) AS ok
), handover AS MATERIALIZED (
	SELECT pg_advisory_unlock($2::int4, $3::int4) FROM lease
)
SELECT (SELECT ok FROM lease), (SELECT count(*) FROM handover)`

// heldBy returns the SQL query for the backends holding the exclusive
// advisory lock whose key halves are the parameters hi and lo, in this
// database.
func heldBy(hi, lo string) string {
	return `SELECT l.pid FROM pg_locks AS l
	WHERE l.locktype = 'advisory'
		AND l.database = (SELECT d.oid FROM pg_database AS d WHERE d.datname = current_database())
		AND l.classid::bigint = ` + hi + ` AND l.objid::bigint = ` + lo + ` AND l.objsubid = 1
		AND l.mode = 'ExclusiveLock' AND l.granted`
}

// A holder's mark is the advisory lock whose two int4 keys are markClass
// and the holder's backend PID: a holder takes it with the lock, and lock
// waiters wait on it (see AdvisoryStore, Wake-ups). A mark belongs to a
// backend, not to a name, so a new holder never waits for the lock
// waiters of the previous one. markClass is the first 4 bytes of the
// SHA-256 of "leader:mark", read as a big-endian int4; markClassOID is the
// same as pg_locks shows it (an oid, so unsigned).
const (
	markClass    = "-1385121490"
	markClassOID = "2909845806"
)

// namedChannelSetting and namedPayloadSetting are the session settings in
// which a holder's release statement leaves the candidate channel and the
// payload of the notice that names the candidate to wake first (both empty
// if it named none), for the statements after it: the one that frees the
// lease's lock and sends that notice in its own transaction, so that the
// candidate never finds the lock still held, and the one that frees the
// holder's mark later if a candidate was named (see releaseOn).
const (
	namedChannelSetting = "leader.release_channel"
	namedPayloadSetting = "leader.release_payload"
)

// claimedSetting and claimedMarkSetting are the transaction's settings in
// which a prepared handover's successor records whether its claimLock
// statement took the lease's lock, and its mark, for its claimRow
// statement after it.
const (
	claimedSetting     = "leader.claimed"
	claimedMarkSetting = "leader.claimed_mark"
)

// namedUnlock returns the second statement of a plain release that may
// name a candidate to wake first (see releaseOn), on the advisory table
// table: $1 the lease's key, $2 the name, $3 the term released. It frees
// the lease's lock, and then sends the notice that the release statement
// left in the session's settings, if any, if the lock was freed and the
// row is free under the term (so that settings left by an earlier
// release, when this one's statement failed, send nothing): on its
// commit, after the lock is free. It returns whether it unlocked, and how
// many notices it sent.
func namedUnlock(table string) string {
	return `WITH unlocked AS MATERIALIZED (
	SELECT pg_advisory_unlock($1::bigint) AS ok
), notified AS (
	SELECT pg_notify(current_setting('` + namedChannelSetting + `'), current_setting('` + namedPayloadSetting + `'))
	FROM unlocked AS u
	WHERE u.ok AND coalesce(current_setting('` + namedChannelSetting + `', true), '') <> ''
		AND EXISTS (SELECT FROM ` + table + ` AS a WHERE a.name = $2 AND a.term = $3 AND a.holder_token IS NULL)
)
SELECT (SELECT ok FROM unlocked), (SELECT count(*) FROM notified)`
}

// namedMark is the third statement of a plain release that may name a
// candidate (see releaseOn): $1 how long, in seconds, to wait before the
// statement after it frees the holder's mark, if the release named one.
// It then clears the settings that the release statement left.
const namedMark = `WITH waited AS MATERIALIZED (
	SELECT pg_sleep(CASE WHEN coalesce(current_setting('` + namedChannelSetting + `', true), '') <> '' THEN $1::float8 ELSE 0 END)
)
SELECT set_config('` + namedChannelSetting + `', '', false), set_config('` + namedPayloadSetting + `', '', false) FROM waited`

// markedBy returns the SQL query for the backend whose PID is pid (an SQL
// expression) if it holds its mark, in this database.
func markedBy(pid string) string {
	return `SELECT l.pid FROM pg_locks AS l
	WHERE l.locktype = 'advisory'
		AND l.database = (SELECT d.oid FROM pg_database AS d WHERE d.datname = current_database())
		AND l.classid::bigint = ` + markClassOID + ` AND l.objid::bigint = ` + pid + ` AND l.objsubid = 2
		AND l.pid = ` + pid + ` AND l.mode = 'ExclusiveLock' AND l.granted`
}

// holderSettings returns the SQL select list that arms the server's side of
// the holder's deadline on its session: idle_session_timeout ends the
// session, and so frees the lock, once the holder has sent nothing for the
// TTL; tcp_user_timeout and the keepalives do the same for a connection
// that went silent while the server had something to say or was probing.
// ms is the parameter with the TTL in milliseconds, idle and interval those
// with the keepalive idle time and interval in seconds (all as text).
func holderSettings(ms, idle, interval string) string {
	return `set_config('idle_session_timeout', ` + ms + `, false),
		set_config('tcp_user_timeout', ` + ms + `, false),
		set_config('tcp_keepalives_idle', ` + idle + `, false),
		set_config('tcp_keepalives_interval', ` + interval + `, false),
		set_config('tcp_keepalives_count', '3', false)`
}

// durableCommit is the SQL expression, evaluated in a statement that
// grants or renews, that makes its transaction's commit wait until its WAL
// is written out (and flushed, unless fsync is off) when the session's
// synchronous_commit is off: 'local' for this transaction only. Any other
// setting is kept, so that one that also waits for standbys still does. A
// commit made with synchronous_commit off is acknowledged before its WAL
// leaves the server's memory, and a server crash (an immediate shutdown, a
// killed postmaster or backend, a lost host) loses it: a lost grant would
// give its term again to the next leader, and a lost renewal would end a
// lease before its holder's local deadline (DESIGN.md invariants 2 and 1).
// A release needs none: a release lost with a crash only leaves the lease
// to run out, and any later commit that survives (a grant) carries the
// release with it, as WAL is replayed in order. The expression must sit in
// a CTE that the statement reads: PostgreSQL does not run a CTE without
// data-modifying statements that nothing reads.
const durableCommit = `set_config('synchronous_commit', CASE current_setting('synchronous_commit')
		WHEN 'off' THEN 'local' ELSE current_setting('synchronous_commit') END, true)`

// followerSettings disarms holderSettings after a release: a follower's
// session may sit idle for longer than a TTL between attempts.
const followerSettings = `set_config('idle_session_timeout', '0', false),
		set_config('tcp_user_timeout', '0', false),
		set_config('tcp_keepalives_idle', '0', false),
		set_config('tcp_keepalives_interval', '0', false),
		set_config('tcp_keepalives_count', '0', false)`

// observeRow returns the SQL query for the lease of the name in parameter
// name, with the key halves in parameters hi and lo, in table: the row,
// whether its recorded holder backend holds the lock now ("held"), whether
// any backend holds it exclusively ("locked": true without "held" while a
// grant has taken the lock but not yet committed its row), how long the
// lease has left, and its transfer columns (transferColumns). A holder
// that is idle (between heartbeats) is ended by the server once it has
// been idle for its TTL, so the lease has state_change + ttl - now left; a
// holder running a statement has its whole TTL, counted from when the
// statement ends. Where pg_stat_activity hides another role's sessions,
// the whole TTL is reported.
func observeRow(table, name, hi, lo string) string {
	return `SELECT a.term, a.holder_id, a.acquired_at, a.ttl, h.pid IS NOT NULL AS held,
		EXISTS (` + heldBy(hi, lo) + `) AS locked,
		` + remainingSQL("h.pid IS NOT NULL", "a.ttl") + ` AS remaining, ` + transferColumns("a") + `
	FROM ` + table + ` AS a
	LEFT JOIN LATERAL (` + heldBy(hi, lo) + ` AND l.pid = a.holder_pid LIMIT 1) AS h ON true
	LEFT JOIN pg_stat_activity AS act ON act.pid = h.pid
	WHERE a.name = ` + name
}

// remainingSQL returns the SQL expression for how long a lease has left,
// given the SQL conditions held (whether its holder holds the lock) and the
// lease's ttl, with act its holder's row of pg_stat_activity (see
// observeRow).
func remainingSQL(held, ttl string) string {
	return `CASE
			WHEN NOT (` + held + `) THEN interval '0'
			WHEN act.state = 'idle' AND act.state_change IS NOT NULL THEN
				least(` + ttl + `, greatest(act.state_change + ` + ttl + ` - clock_timestamp(), interval '1 millisecond'))
			ELSE ` + ttl + `
		END`
}

// grantTemplate is the grant statement, with {lock} the CTE "lk" that takes
// the lock, and {cur} and {locked} what a refused candidate reads (see
// newAdvisoryStatements).
var grantTemplate = `
WITH rs AS MATERIALIZED (
	SELECT FROM {t} AS a WHERE a.name = $1 AND ` + reservedForOther("a", "$3") + `
), {lock}, st AS MATERIALIZED (
	SELECT s.term_floor FROM {s} AS s WHERE s.name = $1 AND s.strategy = 'advisory' AND (SELECT lk.got FROM lk) FOR KEY SHARE
), {ep}, marked AS MATERIALIZED (
	SELECT pg_try_advisory_lock(` + markClass + `, pg_backend_pid()) AS ok FROM lk WHERE lk.got
), other AS (
	SELECT a.name FROM {t} AS a WHERE a.key = $2 AND a.name <> $1 LIMIT 1
), previous AS (
	SELECT a.holder_token IS NOT NULL AS unreleased, a.holder_pid, a.term FROM {t} AS a WHERE a.name = $1
), granted AS (
	INSERT INTO {t} AS a (name, key, term, holder_token, holder_id, holder_pid, ttl, acquired_at, priority, reason)
	SELECT $1, $2, greatest(st.term_floor, ep.floor) + 1, $3, $4, pg_backend_pid(), $5::interval, clock_timestamp(), $11, ''
	FROM lk, st, ep WHERE lk.got AND ep.ok AND NOT EXISTS (SELECT FROM other)
	ON CONFLICT (name) DO UPDATE
	SET (key, term, holder_token, holder_id, holder_pid, ttl, acquired_at, priority, reason, ` + clearedTransfer + `) = (
		excluded.key, greatest(a.term, (SELECT st.term_floor FROM st), (SELECT ep.floor FROM ep)) + 1, excluded.holder_token, excluded.holder_id,
		excluded.holder_pid, excluded.ttl, excluded.acquired_at, excluded.priority,
		` + grantReasonSQL("a", "excluded.holder_token", "false") + `, ` + clearedValues + `)
	WHERE NOT ` + reservedForOther("a", "excluded.holder_token") + `
	RETURNING a.term, a.acquired_at, a.name, a.priority, a.reason
), armed AS (
	SELECT ` + holderSettings("$6", "$7", "$8") + ` FROM granted
), durable AS (
	SELECT ` + durableCommit + ` FROM granted
), {fence}, {enlist}, cur AS (
	{cur}
)
SELECT lk.got, g.term, g.acquired_at, (SELECT name FROM other),
	(SELECT count(*) FROM armed) + (SELECT count(*) FROM durable) + (SELECT count(*) FROM fenced),
	c.term, c.holder_id, c.acquired_at, coalesce(c.held, false), coalesce(c.remaining, interval '0'),
	{locked},
	coalesce((SELECT unreleased FROM previous), false), (SELECT holder_pid FROM previous), (SELECT term FROM previous),
	coalesce((SELECT ok FROM marked), false), EXISTS (SELECT FROM st), (SELECT ep.ok FROM ep), EXISTS (SELECT FROM rs),
	coalesce(g.priority, c.priority, 0), coalesce(g.reason, c.reason, ''), c.request_to, c.request_reason, c.request_left,
	c.successor_id, c.reserved_left
FROM lk
LEFT JOIN granted AS g ON true
LEFT JOIN cur AS c ON true`

// A refused candidate's view of the lease, in a grant statement: "cur",
// and "locked" (whether anyone holds the lock exclusively), in one of two
// forms. observed is the lease as Observe reports it, from the server's
// lock and activity views. claimed reads neither view whole: the row's
// holder is taken to hold the lock if its backend holds its mark (see
// markClass), found by one try of the mark, shared, let go at once if it
// was granted; someone holds the lock, since it was refused. How long it
// has left is read from that one backend's activity, as observeRow does.
// "locked" is true. The lock view costs a busy server time that the
// winner of a handover, whose statement runs beside the losers', would
// otherwise wait for.
var (
	observedCur    = `SELECT o.* FROM (` + observeRow("{t}", "$1", "$9", "$10") + `) AS o WHERE NOT (SELECT lk.got FROM lk)`
	observedLocked = `coalesce(c.locked, lk.got OR EXISTS (` + heldBy("$9", "$10") + `))`
	claimedCur     = `SELECT r.term, r.holder_id, r.acquired_at, r.ttl, r.held, true AS locked,
		` + remainingSQL("r.held", "r.ttl") + ` AS remaining, ` + transferNames("r") + `
	FROM (
		SELECT a.term, a.holder_id, a.acquired_at, a.ttl, a.holder_pid, ` + transferColumns("a") + `,
			a.holder_token IS NOT NULL AND a.holder_pid IS NOT NULL AND NOT (
				CASE WHEN pg_try_advisory_lock_shared(` + markClass + `, a.holder_pid)
				THEN pg_advisory_unlock_shared(` + markClass + `, a.holder_pid) ELSE false END) AS held
		FROM {t} AS a WHERE a.name = $1 AND NOT (SELECT lk.got FROM lk)
	) AS r
	LEFT JOIN LATERAL pg_stat_get_activity(r.holder_pid) AS act ON r.held`
	claimedLocked = `($9::bigint, $10::bigint) IS NOT NULL` // true; it names $9 and $10, which a statement must use
)

func newAdvisoryStatements(opts Options) advisoryStatements {
	table, strategies := opts.qualifiedAdvisoryTable(), opts.qualifiedStrategyTable()
	// {t} is the table, {s} the strategy table, {ep} the epoch CTEs (see
	// epochCTEs), {enlist} the CTEs that enlist a refused candidate (see
	// enlistCTEs), {grant} and {freed} the NOTIFY payloads of a grant and
	// of a release (or handover) of the row's name.
	fill := strings.NewReplacer("{t}", table, "{s}", strategies, "{ep}", epochCTEs(opts.qualifiedEpochTable(), "$5::interval"),
		"{enlist}", enlistCTEs(opts.qualifiedCandidateTable(), claimedFor(strategies, "$1", "'advisory'"), "$5::interval",
			[4]string{"$1", "$3", "$4", "$11"}, true),
		"{grant}", grantPayload, "{freed}", freedPayload,
		"{dropped}", dropHolderCandidate(opts.qualifiedCandidateTable(), "$2"),
		"{first}", firstCandidate(opts.qualifiedCandidateTable(), "r.name", "$2"),
		"{dibs}", dibsPayload, "{channel}", candidateChannelSQL("$8"),
		"{fence}", fenceAfterGrant(opts)).Replace
	// rgFill fills in releaseGranting's names.
	rgFill := strings.NewReplacer("{t}", table, "{s}", strategies,
		"{ep}", epochCTEs(opts.qualifiedEpochTable(), "(SELECT x.ttl FROM "+table+" AS x WHERE x.name = $1)")).Replace
	// released is the first CTE of the release statements: it frees the
	// lease that the session holds under the token and the term, and
	// records the reservation, if any.
	released := `released AS (
	UPDATE {t} AS a
	SET (holder_token, holder_id, holder_pid, ttl, acquired_at, released_at, ` + clearedTransfer + `) = (
		NULL, '', NULL, NULL, NULL, c.now, NULL, NULL, NULL, $4, $5, $6, c.now + $7::bigint * interval '1 microsecond')
	FROM clock_timestamp() AS c(now)
	WHERE a.name = $1 AND a.holder_token = $2 AND a.term = $3 AND a.holder_pid = pg_backend_pid()
	RETURNING a.name
)`
	grant := func(lock, cur, locked string) string {
		return fill(strings.NewReplacer("{lock}", lock, "{cur}", cur, "{locked}", locked).Replace(grantTemplate))
	}
	// The lock is not tried while the snapshot shows the lease reserved
	// for another candidate ("rs"; see Acquire).
	tryLock := `lk AS MATERIALIZED (
	SELECT CASE WHEN EXISTS (SELECT FROM rs) THEN false ELSE pg_try_advisory_lock($2) END AS got
)`
	return advisoryStatements{
		// Grant, on a session that does not hold the lock: $1 name, $2 key,
		// $3 token, $4 candidate ID, $5 ttl, $6 ttl in ms, $7 keepalive
		// idle, $8 keepalive interval, $9 and $10 the key's halves, $11
		// priority.
		//
		// "rs" finds, in the statement's snapshot, the lease released and
		// reserved for another candidate's token (see ReleaseTo): then
		// "lk" does not try the lock, and the candidate is refused and
		// told the successor ("reserved", the 17th column), holding
		// nothing, so that a follower woken by a handover never holds the
		// lock, even for a moment, while the successor comes for it.
		// Otherwise "lk" tries the lock (materialized, so it runs exactly
		// once).
		// "marked" then takes the holder's mark (see markClass), for lock
		// waiters to wait on; only a stray session of someone else's,
		// using the same two int4 keys, could hold it, and then the lock
		// is held without it, and lock waiters wait on the lock itself.
		// "st" locks the name's row of the strategy table (FOR KEY SHARE)
		// if it names the advisory strategy; without it nothing is
		// granted, and the caller unlocks, claims the name
		// (claimStrategy) and tries again. A grant's term is above the
		// row's term_floor.
		// "other" is another name already using the key: then nothing is
		// granted, and the caller unlocks. "granted" bumps the term in the
		// same statement, so the term grows at every grant and a grant
		// without a term cannot happen; it takes the row over whatever it
		// says, since holding the lock proves its holder is gone, unless
		// the row, as it stands, is reserved for another candidate (a
		// handover committed after the snapshot was taken): then nothing
		// is granted, and the caller unlocks and looks again. It records
		// the priority and why it was granted (grantReasonSQL), and clears
		// any request and reservation. The
		// holder's settings and a durable commit (durableCommit) follow a
		// grant; its wake-up does not (see announce). "cur" is the lease as it stood
		// when the statement began, for a refused candidate only (the
		// server's lock and activity views cost a busy server time);
		// "previous" is the row as the snapshot shows it: whether it
		// names a holder, its backend PID and the term. Whether the last
		// holder left without a release (see Options.TakeoverGrace) is
		// told by the grant's reason instead, computed from the row as
		// the update found it, which a release that committed after the
		// snapshot may have freed (see grantResult.leftUnreleased).
		// When nothing was granted, whatever refused it (the lock not
		// taken, the lease reserved for another, a failover's grace),
		// "enlisting" and "enlisted" enlist the
		// candidate for EnlistFactor times the TTL, if the strategy table
		// gives the name to the advisory strategy (see enlistCTEs); a
		// grant writes no entry.
		grant: grant(tryLock, observedCur, observedLocked),

		// Grant, quick: as grant, with the same parameters, but a refused
		// candidate reads the row alone (claimedCur): the first attempt
		// of a candidate (see acquireOn).
		grantQuick: grant(tryLock, claimedCur, claimedLocked),

		// Grant on a session that has just taken the lock (see queue):
		// as grant, with the same parameters, but "lk" checks that this
		// backend holds the lock instead of taking it. A statement of its
		// own, so that its snapshot, taken after the lock, shows the row
		// as the last holder left it.
		grantLocked: grant(`lk AS MATERIALIZED (
	SELECT EXISTS (`+heldBy("$9", "$10")+` AND l.pid = pg_backend_pid()) AS got
)`, observedCur, observedLocked),

		// Announce, the wake-up of a grant, on the holder's session once
		// the grant has committed and its reply is in: $1 name, $2 token,
		// $3 term, $4 channel. Only while this backend holds the row
		// under the term. A transaction of its own, after the grant's: a
		// notification wakes every listener's backend and process, and
		// every lock waiter then looks at the lock; sent in the grant's
		// transaction, that crowd would run while the server sends the
		// grant's reply and the winner reads it, on a busy server adding
		// ten milliseconds and more to a handover.
		// A grant that a prepared handover's release made
		// (releaseGranting) left the lease reserved for its holder: the
		// announce clears that reservation, which would otherwise hold
		// off the other candidates, after this holder's end, until it
		// ran out.
		announce: fill(`WITH claimed AS (
	UPDATE {t} AS a SET (successor_token, successor_id, successor_reason, reserved_until) = (NULL, NULL, NULL, NULL)
	WHERE a.name = $1 AND a.holder_token = $2 AND a.term = $3 AND a.holder_pid = pg_backend_pid() AND a.successor_token = a.holder_token
	RETURNING a.name
)
SELECT pg_notify($4, {grant}), (SELECT count(*) FROM claimed) FROM {t} AS a
	WHERE a.name = $1 AND a.holder_token = $2 AND a.term = $3 AND a.holder_pid = pg_backend_pid()`),

		// Queue for the lock: $1 key, $2 the longest wait, as a
		// lock_timeout in ms (text). "lt" sets it for this statement's
		// transaction only, before the wait begins. A wait that runs out
		// fails the statement with SQLSTATE 55P03 (lock_not_available),
		// holding nothing.
		queue: `WITH lt AS MATERIALIZED (
	SELECT set_config('lock_timeout', $2, true) AS v
)
SELECT pg_advisory_lock($1) IS NOT NULL FROM lt`,

		// Re-grant to the holder, on its session: $1 name, $2 token, $3
		// candidate ID, $4 ttl, $5 ttl in ms, $6 keepalive idle, $7
		// keepalive interval, $8 channel, $9 and $10 the key's halves, $11
		// priority. Only while this backend still holds the lock and the
		// row; committed durably, as a grant. A grant to the holder
		// itself: its reason is empty, and it clears any request.
		regrant: fill(`
WITH granted AS (
	UPDATE {t} AS a
	SET (term, holder_id, ttl, acquired_at, priority, reason, ` + clearedTransfer + `) = (
		a.term + 1, $3, $4::interval, clock_timestamp(), $11, '', ` + clearedValues + `)
	WHERE a.name = $1 AND a.holder_token = $2 AND a.holder_pid = pg_backend_pid()
		AND EXISTS (` + heldBy("$9", "$10") + ` AND l.pid = pg_backend_pid())
	RETURNING a.term, a.acquired_at, a.name
), armed AS (
	SELECT ` + holderSettings("$5", "$6", "$7") + ` FROM granted
), notified AS (
	SELECT pg_notify($8, {grant}) FROM granted
), durable AS (
	SELECT ` + durableCommit + ` FROM granted
), {fence}
SELECT g.term, g.acquired_at, (SELECT count(*) FROM armed) + (SELECT count(*) FROM notified) + (SELECT count(*) FROM durable)
	+ (SELECT count(*) FROM fenced)
FROM granted AS g`),

		// Renew, the heartbeat, on the holder's session: $1 name, $2 token,
		// $3 term, $4 ttl, $5 ttl in ms, $6 keepalive idle, $7 keepalive
		// interval, $8 and $9 the key's halves. It proves the session is
		// alive and still holds the lock under the term, and re-arms the
		// server's timeouts (the TTL may change); the row is written only
		// when the TTL changed. It reads the transfer columns
		// (transferColumns): a pending request is what the holder reads
		// there.
		renew: fill(`
WITH cur AS (
	SELECT a.acquired_at, a.ttl, ` + transferColumns("a") + ` FROM {t} AS a
	WHERE a.name = $1 AND a.holder_token = $2 AND a.term = $3 AND a.holder_pid = pg_backend_pid()
		AND EXISTS (` + heldBy("$8", "$9") + ` AND l.pid = pg_backend_pid())
), changed AS (
	UPDATE {t} AS a SET ttl = $4::interval
	FROM cur WHERE a.name = $1 AND cur.ttl IS DISTINCT FROM $4::interval
	RETURNING a.name
), armed AS (
	SELECT ` + holderSettings("$5", "$6", "$7") + ` FROM cur
)
SELECT c.acquired_at, (SELECT count(*) FROM changed) + (SELECT count(*) FROM armed), ` + transferNames("c") + `
FROM cur AS c`),

		// Release, on the holder's session, the first of two statements:
		// $1 name, $2 token, $3 term. Clears the row (keeping the term),
		// only if this backend holds the row under the term, and commits;
		// unlock follows, in the same round trip (see releaseOn). A
		// follower that comes between the two sees the lock taken and the
		// row free, and looks again (see acquireOn). For a handover
		// (ReleaseTo), $4 is the successor's token, $5 its candidate ID,
		// $6 the reason of its grant and $7 how long, in microseconds, the
		// lease is reserved for it; all NULL for a plain release. $8 is
		// the store's channel. Clears any request, and removes the
		// holder's own entry among the candidates (see
		// dropHolderCandidate). A plain release picks the candidate to
		// wake first, as the lease strategy's does (firstCandidate,
		// dibsPayload), if $8 is short enough to have candidate channels,
		// and leaves the channel and payload of the notice that names it
		// in the session's settings (namedChannelSetting,
		// namedPayloadSetting; empty if none): the statement after it
		// (namedUnlock) frees the lease's lock and sends that notice, on
		// the candidate's channel alone (see candidateChannel), whose
		// store wakes it, and the holder's mark, on which every
		// process's lock waiter waits, is freed markAfter later (see
		// releaseOn), so that the other processes are not woken beside
		// the named candidate's grant. Returns 1 if released, and whether
		// it named a candidate.
		release: fill(`
WITH ` + released + `, {dropped}, named AS (
	SELECT {channel} AS channel, {dibs} AS payload FROM (
		SELECT r.name, NULL::text AS successor_token, NULL::timestamptz AS reserved_until, d.first_token, true AS dibs, true AS targeted
		FROM released AS r CROSS JOIN LATERAL ({first}) AS d
		WHERE $4::text IS NULL AND octet_length($8::text) <= ` + strconv.Itoa(maxCandidateChannel) + `
			AND octet_length(r.name) + octet_length(d.first_token) <= ` + strconv.Itoa(maxPayloadLength-32) + `
	) AS x
), flagged AS (
	SELECT set_config('` + namedChannelSetting + `', coalesce((SELECT channel FROM named), ''), false) AS channel,
		set_config('` + namedPayloadSetting + `', coalesce((SELECT payload FROM named), ''), false) AS payload
)
SELECT (SELECT count(*) FROM released), (SELECT f.channel <> '' AND f.payload <> '' FROM flagged AS f)`),

		// Release notice, the wake-up of a release, on the released
		// session once the release's two statements have their replies:
		// $1 name, $2 term, $3 channel. Only while the row is still free
		// under the term. A transaction of its own, after the unlock, for
		// the reason given at announce: the followers' lock waiters wake
		// them as the unlock frees the holder's mark, and a notification
		// that went out with the release would wake every listener beside
		// them. Lock waiters cover it (see coverage), so it wakes only the
		// followers of a process without one.
		releaseNotice: fill(`SELECT pg_notify($3, {freed}) FROM {t} AS a
	WHERE a.name = $1 AND a.term = $2 AND a.holder_token IS NULL`),

		// Announced release notice: releaseNotice for a grant whose own
		// notification never went out (released first), preceded by it,
		// in one transaction, so that listeners get the two in order.
		announcedReleaseNotice: fill(`SELECT pg_notify($3, {grant}), pg_notify($3, {freed}) FROM {t} AS a
	WHERE a.name = $1 AND a.term = $2 AND a.holder_token IS NULL`),

		// Unlock, the second statement of a release: $1 key. Unlocks, then
		// lets go of every other advisory lock the session holds (the
		// session is this name's only, so they are this lock's mark and
		// any second hold on the lock itself), and disarms the holder's
		// timeouts, in this order. The holder's timeouts stay armed until
		// then, so a holder that stops between the two statements still
		// has its session ended.
		unlock: `
WITH unlocked AS MATERIALIZED (
	SELECT pg_advisory_unlock($1) AS ok
), cleared AS MATERIALIZED (
	SELECT pg_advisory_unlock_all() FROM unlocked
), disarmed AS (
	SELECT ` + followerSettings + ` FROM cleared
)
SELECT (SELECT ok FROM unlocked), (SELECT count(*) FROM disarmed)`,

		// Unlock rest, the end of a prepared handover's release, whose
		// lease's lock and handover's lock were unlocked before it (see
		// releaseOn): lets go of every other advisory lock the session
		// holds (its mark), and disarms the holder's timeouts, as
		// unlock does.
		unlockRest: `
WITH cleared AS MATERIALIZED (
	SELECT pg_advisory_unlock_all()
), disarmed AS (
	SELECT ` + followerSettings + ` FROM cleared
)
SELECT true, (SELECT count(*) FROM disarmed)`,

		namedUnlock:      namedUnlock(table),
		namedMark:        namedMark,
		unlockHandedOver: unlockHandedOver,

		// Release of a prepared handover whose successor waits (see
		// releaseOn): the release statement's first CTE alone, with its
		// parameters $1 to $7 ($4 to $7 the reservation). It neither
		// looks for a candidate to name (a handover names its successor)
		// nor removes the holder's own entry among the candidates, which
		// dropHolder does once the successor's grant has had its turn: on
		// the handover's path, the release did both in 0.64 ms p50 (the
		// server's clock, in the bench), this takes 0.45 ms.
		// Returns 1 if released, and false.
		releaseHandedOver: fill(`
WITH ` + released + `
SELECT (SELECT count(*) FROM released), false`),

		// Release of a prepared handover whose successor waits, and
		// whose waiting backend is known (see releaseOn): $1 to $7 as for
		// releaseHandedOver, $8 the successor's backend PID, $9 its
		// priority. It grants the lease to the successor as it releases
		// it, in the same update, while this session still holds the
		// lock: the next term (above the strategy row's term_floor and
		// the epoch's floor, as a grant's), the successor's token, ID
		// and backend, the row's TTL (the successor's claim corrects it
		// if its own differs), acquired now, its priority, and the
		// handover's reason; and the lease reserved for the successor,
		// as ReleaseTo reserves it: a candidate woken meanwhile (the
		// successor slow to claim it) is refused without trying the lock
		// (reservedForOther: a row whose holder is its successor counts
		// as released until the reservation ends; the grant's announce
		// clears it once the successor holds the lock). The successor's waiting
		// statements then only take the lease's lock and its mark, and
		// read the row (claimLock, claimRow), writing nothing: the
		// handover's path loses the grant's write, about 0.5 ms of the
		// server's time. The row names the successor before it holds
		// the lock, so nobody leads under the new term until it has
		// taken the lock (see claimRow); if someone else takes the lock
		// first (one whose snapshot came before the release), its grant
		// finds the row reserved and lets go, and the successor's claim,
		// which waits for the lock (beforeLockWait at most), takes it
		// then; a successor that does not get it in time tries as usual,
		// granted in its own statement with the term after it
		// (grantReasonSQL: for the handover's reason, without
		// TakeoverGrace: the row names it).
		// Where the strategy row does not give the name to the advisory
		// strategy, or a failover's grace holds grants off (see
		// epochCTEs, with the row's TTL), it is releaseHandedOver: the
		// lease released and reserved for the successor, whose claim
		// then finds nothing and which is granted by its grant
		// statement. Committed durably when it grants (durableCommit):
		// the successor leads under the term it wrote. Returns 1 if
		// released, and whether it granted.
		//
		// It takes the name's fence lock once it has granted (see
		// fenceAfterGrant), unless staged (releaseGrantingStaged, whose
		// commit takes it).
		releaseGranting: rgFill(releaseGranting("pg_advisory_xact_lock(" + stageKeySQL(fenceKeyPrefix, opts.qualifiedTable(), "$1") + ")")),

		// releaseGranting as a staged release runs it (see
		// advisoryPrepared.Stage): without the fence lock, which the
		// staged release's commit takes (stagedUnlock), as it must not be
		// held while the old leader's OnDemoted runs.
		releaseGrantingStaged: rgFill(releaseGranting("true")),

		// Claim lock, the statement that a prepared handover's successor
		// runs once it has the handover's lock (see grantAfterHandover),
		// before claimRow, in the same transaction: $1 name, $2 token, $3
		// key. If its snapshot, taken after the handover's lock, shows the
		// row naming this token and this backend (releaseGranting granted
		// it the lease), it takes the lease's lock, waiting for it as
		// long as lock_timeout allows (beforeLockWait: another session
		// may hold it for a moment as the handover's lock is freed, a
		// follower whose grant's snapshot came before the release and
		// which lets go once it finds the row reserved, or a lock waiter
		// reading the row; tried once, the claim failed then, and the
		// successor was granted by its own statement under the term after,
		// about one transfer in a hundred in the bench), and then
		// the mark, in the same statement (a lock waiter that looked
		// between the two would take the row's holder for one without its
		// mark, and wait on the lease's lock itself); it records whether
		// it took each in the transaction's settings claimedSetting and
		// claimedMarkSetting.
		claimLock: fill(`WITH lk AS MATERIALIZED (
	SELECT CASE WHEN EXISTS (SELECT FROM {t} AS a WHERE a.name = $1 AND a.holder_token = $2 AND a.holder_pid = pg_backend_pid())
		THEN (SELECT true FROM pg_advisory_lock($3::bigint)) ELSE false END AS got
), mk AS MATERIALIZED (
	SELECT pg_try_advisory_lock(` + markClass + `, pg_backend_pid()) AS ok FROM lk WHERE lk.got
)
SELECT set_config('` + claimedSetting + `', (SELECT lk.got FROM lk)::text, true),
	set_config('` + claimedMarkSetting + `', coalesce((SELECT mk.ok FROM mk), false)::text, true)`),

		// Claim row, after claimLock, in a statement of its own, so that
		// its snapshot, taken after the lock, shows the row as the last
		// holder of the lock left it: $1 name, $2 token, $3 key, $4 ttl,
		// $5 ttl in ms, $6 keepalive idle, $7 keepalive interval. If
		// claimLock took the lock and the row still names this token and
		// this backend, the lease is this session's under the row's term:
		// it arms the holder's settings, and corrects the
		// row's TTL if it is not this candidate's (the only write, in
		// that case alone); it returns the term, when it was acquired,
		// whether claimLock took the mark, the priority and the reason. If
		// claimLock took the lock but the row names someone else now (a
		// candidate that took the lock between the release and
		// claimLock, was granted and let go), it lets go of the lock and
		// the mark, and returns NULLs, as when claimLock took nothing: the
		// successor then tries as usual.
		claimRow: fill(`
WITH me AS MATERIALIZED (
	SELECT a.term, a.acquired_at, a.ttl, a.priority, a.reason FROM {t} AS a
	WHERE coalesce(current_setting('` + claimedSetting + `', true), '') = 'true'
		AND a.name = $1 AND a.holder_token = $2 AND a.holder_pid = pg_backend_pid()
), marked AS MATERIALIZED (
	SELECT coalesce(current_setting('` + claimedMarkSetting + `', true), '') = 'true' AS ok FROM me
), armed AS (
	SELECT ` + holderSettings("$5", "$6", "$7") + ` FROM me
), changed AS (
	UPDATE {t} AS a SET ttl = $4::interval FROM me
	WHERE a.name = $1 AND a.holder_token = $2 AND a.holder_pid = pg_backend_pid() AND me.ttl IS DISTINCT FROM $4::interval
	RETURNING a.name
), dropped AS MATERIALIZED (
	SELECT pg_advisory_unlock($3::bigint) AS ok,
		CASE WHEN coalesce(current_setting('` + claimedMarkSetting + `', true), '') = 'true'
			THEN pg_advisory_unlock(` + markClass + `, pg_backend_pid()) END AS mark
	WHERE coalesce(current_setting('` + claimedSetting + `', true), '') = 'true' AND NOT EXISTS (SELECT FROM me)
)
SELECT m.term, m.acquired_at, coalesce((SELECT ok FROM marked), false), m.priority, m.reason,
	(SELECT count(*) FROM armed) + (SELECT count(*) FROM changed) + (SELECT count(*) FROM dropped)
FROM (SELECT 1) AS x LEFT JOIN me AS m ON true`),

		// The removal of the holder's own entry among the candidates
		// after a prepared handover's release (releaseHandedOver): see
		// dropReleasedHolder.
		dropHolder: dropReleasedHolder(opts.qualifiedCandidateTable(), table),

		// Observe: $1 name, $2 and $3 the key's halves.
		observe: observeRow(table, "$1", "$2", "$3"),

		// Reserved, what a lock waiter reads as a holder lets go of its
		// mark (or of the lease's lock): $1 name, $2 and $3 the key's
		// halves. The token that the name's released lease is reserved
		// for, and how long it stays reserved, in microseconds on the
		// server's clock (NULL and 0 if it is not reserved), and the
		// backend that the row names as its holder if that backend holds
		// the lock now (NULL otherwise: when it is another backend than
		// the one that let go, the lease has been granted already, as a
		// prepared handover's successor's is); no row if the name has
		// none. The row alone would not do: it may name a backend that
		// is gone, or one of an earlier server (after a failover, every
		// row does), whose PID a live backend may have now. Then, with
		// that backend, the row's term.
		reserved: fill(`SELECT CASE WHEN r.open THEN a.successor_token END,
	CASE WHEN r.open THEN (extract(epoch FROM a.reserved_until - clock_timestamp()) * 1000000)::bigint ELSE 0 END,
	h.pid, CASE WHEN h.pid IS NOT NULL THEN a.term END
FROM {t} AS a
CROSS JOIN LATERAL (SELECT CASE WHEN a.holder_token IS NOT NULL AND EXISTS (` + heldBy("$2", "$3") + ` AND l.pid = a.holder_pid) THEN a.holder_pid END) AS h(pid)
CROSS JOIN LATERAL (SELECT (a.holder_token IS NULL OR (a.holder_token = a.successor_token AND h.pid IS NULL))
	AND a.reserved_until > clock_timestamp()) AS r(open)
WHERE a.name = $1`),

		// Waiter, a lock waiter's look: $1 and $2 the key's halves, $3
		// the name. The PID of the lock's holder (NULL if it is free),
		// whether the holder holds its mark too, and the backend that the
		// name's row names as its holder and the row's term (NULL if it
		// names none), and whether the row is a prepared handover's grant
		// that its successor may not have claimed yet (its holder is its
		// successor, still reserved: see releaseGranting), whose lock may
		// be held a moment without its mark, as a grant in flight's.
		waiter: fill(`WITH k AS MATERIALIZED (` + heldBy("$1", "$2") + ` LIMIT 1),
r AS (SELECT a.holder_pid, a.term, coalesce(a.holder_token = a.successor_token AND a.reserved_until > clock_timestamp(), false) AS claiming
	FROM {t} AS a WHERE a.name = $3 AND a.holder_token IS NOT NULL)
SELECT (SELECT k.pid FROM k), EXISTS (SELECT FROM k WHERE EXISTS (` + markedBy("k.pid") + `)),
	(SELECT r.holder_pid FROM r), (SELECT r.term FROM r), coalesce((SELECT r.claiming FROM r), false)`),

		// Held here: whether this session holds the lock; $1 and $2 the
		// key's halves.
		heldHere: `SELECT EXISTS (` + heldBy("$1", "$2") + ` AND l.pid = pg_backend_pid())`,

		// Request, RequestTransfer's: $1 name, $2 and $3 the key's halves,
		// $4 the candidate ID asked for, $5 the reason, $6 how long it
		// stays pending (NULL clears it). "cur" is the lease as Observe
		// reports it; the request is recorded only if it is held, and
		// still held under the same term by a holder once the row is
		// locked. Returns the lease, with the request recorded (none if
		// it was not) and a last column saying whether it was; no row if
		// the name has none.
		request: fill(`
WITH cur AS MATERIALIZED (
	` + observeRow("{t}", "$1", "$2", "$3") + `
), req AS (
	UPDATE {t} AS a
	SET (request_to, request_reason, request_until) = ($4, $5, c.now + $6::interval)
	FROM cur, clock_timestamp() AS c(now)
	WHERE a.name = $1 AND cur.held AND a.term = cur.term AND a.holder_token IS NOT NULL
	RETURNING a.request_to, a.request_reason, a.request_until - clock_timestamp() AS request_left, true AS recorded
)
SELECT c.term, c.holder_id, c.acquired_at, c.held, c.remaining, c.priority, c.reason,
	r.request_to, r.request_reason, r.request_left, c.successor_id, c.reserved_left, coalesce(r.recorded, false)
FROM cur AS c LEFT JOIN req AS r ON true`),
	}
}

// releaseGranting returns advisoryStatements.releaseGranting, with lock
// the SQL expression evaluated once it has granted: the fence lock's
// (see fenceAfterGrant), or true for the staged variant.
func releaseGranting(lock string) string {
	return `WITH st AS MATERIALIZED (
	SELECT s.term_floor FROM {s} AS s WHERE s.name = $1 AND s.strategy = 'advisory' AND $8::int4 IS NOT NULL FOR KEY SHARE
), {ep}, pre AS MATERIALIZED (
	SELECT greatest(st.term_floor, ep.floor) AS floor FROM st, ep WHERE ep.ok
), released AS (
	UPDATE {t} AS a
	SET (term, holder_token, holder_id, holder_pid, ttl, acquired_at, released_at, priority, reason, ` + clearedTransfer + `) = (
		CASE WHEN p.floor IS NULL THEN a.term ELSE greatest(a.term, p.floor) + 1 END,
		CASE WHEN p.floor IS NULL THEN NULL ELSE $4 END,
		CASE WHEN p.floor IS NULL THEN '' ELSE $5 END,
		CASE WHEN p.floor IS NULL THEN NULL ELSE $8::int4 END,
		CASE WHEN p.floor IS NULL THEN NULL ELSE a.ttl END,
		CASE WHEN p.floor IS NULL THEN NULL ELSE c.now END,
		c.now,
		CASE WHEN p.floor IS NULL THEN a.priority ELSE $9::int4 END,
		CASE WHEN p.floor IS NULL THEN a.reason ELSE $6 END,
		NULL, NULL, NULL, $4, $5, $6, c.now + $7::bigint * interval '1 microsecond')
	FROM clock_timestamp() AS c(now) LEFT JOIN pre AS p ON true
	WHERE a.name = $1 AND a.holder_token = $2 AND a.term = $3 AND a.holder_pid = pg_backend_pid()
	RETURNING a.name, p.floor IS NOT NULL AS granted
), durable AS (
	SELECT ` + durableCommit + ` FROM released AS r WHERE r.granted
), fenced AS MATERIALIZED (
	SELECT ` + lock + ` FROM durable
)
SELECT (SELECT count(*) FROM released), coalesce((SELECT r.granted FROM released AS r), false) AND EXISTS (SELECT FROM fenced)`
}
