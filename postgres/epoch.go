package postgres

import (
	"strconv"
	"strings"
)

// epochBits is how far a timeline is shifted into a term: terms granted on
// timeline t are above (t-1) << epochBits, and so above every term of the
// earlier timelines, lost ones included (2^40 grants per timeline).
const epochBits = 40

// epochCTEs returns the common table expressions "ep" and "seen" of a
// grant statement, on the epoch table (see migration 008), with ttl the
// SQL expression of the grant's TTL:
//
//   - "ep" reads the server's timeline ("tl"; NULL on a standby, where
//     the grant's write fails anyway), the term floor of that timeline
//     ("floor"), and whether a grant may be made ("ok"): on a server
//     that is not a primary, when no earlier timeline is recorded, or
//     once the TTL has passed since a server first answered on this
//     timeline. A grant statement grants nothing unless ok.
//   - "seen" records the timeline when it is new, with the server's
//     clock: the start of its grace period. It writes nothing otherwise.
//
// Why: a promoted asynchronous standby can lack grants that the old
// primary acknowledged. Their holders believe they lead until their local
// deadlines, at most a TTL after their last renewal, which reached the old
// primary before it was gone, and so before this server answered on the
// new timeline. Every lease the old primary could have granted has run
// out a TTL after that, measured on this server's clock alone: any offset
// between the two servers' clocks is covered, and their rates must agree
// to within DriftMargin, as for every lease.
func epochCTEs(epochs, ttl string) string {
	return strings.NewReplacer("{e}", epochs, "{ttl}", ttl).Replace(`ep AS MATERIALIZED (
	SELECT t.tl, greatest(coalesce(t.tl, 1) - 1, 0) << ` + strconv.Itoa(epochBits) + ` AS floor,
		t.tl IS NULL
		OR NOT EXISTS (SELECT FROM {e} AS e WHERE e.timeline < t.tl)
		OR EXISTS (SELECT FROM {e} AS e WHERE e.timeline = t.tl AND e.seen_at + {ttl} <= clock_timestamp()) AS ok
	FROM (SELECT CASE WHEN pg_is_in_recovery() THEN NULL
		ELSE ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint END) AS t(tl)
), seen AS (
	INSERT INTO {e} AS e (timeline, seen_at)
	SELECT ep.tl, clock_timestamp() FROM ep
	WHERE ep.tl IS NOT NULL AND NOT EXISTS (SELECT FROM {e} AS x WHERE x.timeline = ep.tl)
	ON CONFLICT (timeline) DO NOTHING
)`)
}
