-- Server epochs: a grant is made only where its lease cannot overlap one
-- that an earlier primary granted and this server never heard of (see
-- "Failover" in the package documentation).
--
-- PostgreSQL's timeline ID grows by one at every promotion of a standby.
-- A row records when a server of this database first answered on a
-- timeline. A grant statement reads the server's timeline, records it if
-- it is new, and grants nothing until the TTL has passed since then, if
-- an earlier timeline is recorded: every lease the old primary could
-- have granted (and the new one lost with the transactions it never
-- replicated) has run out by then, on any clock of the same rate. Terms
-- granted on timeline t are above (t - 1) * 2^40, so that they are above
-- every term of the earlier timelines, including lost ones.
--
-- Migrate records the timeline it runs on, so that a failover soon after
-- the first grants is seen as one.
--
-- {{epoch_table}} is replaced by the quoted, schema-qualified table name.
CREATE TABLE IF NOT EXISTS {{epoch_table}} (
    timeline bigint      PRIMARY KEY,
    seen_at  timestamptz NOT NULL
);
INSERT INTO {{epoch_table}} (timeline, seen_at)
SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint, clock_timestamp()
WHERE NOT pg_is_in_recovery()
ON CONFLICT (timeline) DO NOTHING;
