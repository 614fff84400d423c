-- A view for people and monitoring: who holds each name and until when, on
-- the server's clock, for both strategies, so that nobody has to know
-- that a lease under a heartbeat shows expires_at 'infinity' in its row,
-- or that an advisory lease is a lock. One row per name and strategy that
-- has a row for it:
--
--   name, strategy ('lease' or 'advisory'), held, holder_id and
--   expires_at (NULL while not held), term (the last granted), acquired_at,
--   released_at.
--
-- A lease's expires_at is its own, or its heartbeat's. An advisory lease is
-- held while its holder's backend holds the lock; its expires_at is when
-- the server would end the holder's session if it stayed silent: the TTL
-- after the holder went idle, or a TTL from now while it runs a statement
-- (or when pg_stat_activity hides another role's session).
--
-- {{status_view}}, {{table}}, {{heartbeat_table}} and {{advisory_table}}
-- are replaced by the quoted, schema-qualified names.
CREATE OR REPLACE VIEW {{status_view}} AS
SELECT l.name, 'lease'::text AS strategy, x.held,
    CASE WHEN x.held THEN l.holder_id END AS holder_id,
    l.term, l.acquired_at,
    CASE WHEN x.held THEN x.expires_at END AS expires_at,
    l.released_at
FROM {{table}} AS l
CROSS JOIN LATERAL (
    SELECT e.expires_at, l.holder_token IS NOT NULL AND e.expires_at > clock_timestamp() AS held
    FROM (SELECT CASE WHEN l.heartbeat IS NULL THEN l.expires_at
        ELSE coalesce((SELECT h.expires_at FROM {{heartbeat_table}} AS h WHERE h.id = l.heartbeat AND NOT h.dead), '-infinity') END
    ) AS e(expires_at)
) AS x
UNION ALL
SELECT a.name, 'advisory'::text, x.held,
    CASE WHEN x.held THEN a.holder_id END,
    a.term, a.acquired_at,
    CASE WHEN NOT x.held THEN NULL
        WHEN act.state = 'idle' AND act.state_change IS NOT NULL THEN act.state_change + a.ttl
        ELSE clock_timestamp() + a.ttl END,
    a.released_at
FROM {{advisory_table}} AS a
CROSS JOIN LATERAL (
    SELECT a.holder_pid IS NOT NULL AND EXISTS (
        SELECT FROM pg_locks AS k
        WHERE k.locktype = 'advisory'
            AND k.database = (SELECT d.oid FROM pg_database AS d WHERE d.datname = current_database())
            AND k.classid::bigint = ((a.key >> 32) & 4294967295) AND k.objid::bigint = (a.key & 4294967295)
            AND k.objsubid = 1 AND k.mode = 'ExclusiveLock' AND k.granted AND k.pid = a.holder_pid
    ) AS held
) AS x
LEFT JOIN pg_stat_activity AS act ON act.pid = a.holder_pid AND x.held;
