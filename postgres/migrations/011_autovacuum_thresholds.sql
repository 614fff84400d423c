-- Fewer plan invalidations: autovacuum visits the advisory strategy's
-- table and the candidates' table after 10,000 changed rows (plus its
-- scale factor's share) instead of 50. A VACUUM or ANALYZE of a table
-- updates its row of pg_class (relfrozenxid, reltuples, relallvisible),
-- which invalidates every session's cached plans of statements that read
-- the table; each session plans its next grant, release or unlock again,
-- about a millisecond more on a handover's critical path (see "Planned
-- statements" in the package documentation). With the defaults,
-- autovacuum did so about once a minute at one attempt per follower per
-- TTL, and each of the next handovers paid for it: the tail of the bench's
-- transfers. Both tables are small and their rows are rewritten in place:
-- their updates change no indexed column, so they are heap-only (HOT),
-- and the next access to a page prunes the dead versions without VACUUM.
-- Autovacuum still runs to prevent transaction ID wraparound whatever
-- these say. A manual VACUUM is harmless, and costs each session's next
-- statement its planning.
--
-- {{advisory_table}} and {{candidate_table}} are replaced by the quoted,
-- schema-qualified table names.
ALTER TABLE {{advisory_table}}
    SET (autovacuum_vacuum_threshold = 10000, autovacuum_analyze_threshold = 10000);
ALTER TABLE {{candidate_table}}
    SET (autovacuum_vacuum_threshold = 10000, autovacuum_analyze_threshold = 10000);
