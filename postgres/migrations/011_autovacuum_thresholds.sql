-- Fewer plan invalidations. A VACUUM or ANALYZE of a table updates its row
-- of pg_class (relfrozenxid, reltuples, relallvisible), which invalidates
-- every session's cached plans of the statements that read the table:
-- each session plans its next grant, release or unlock again, about a
-- millisecond more on a handover's path (see "Planned statements" in the
-- package documentation). The advisory strategy's table is written by
-- every grant and release, and the candidates' table by every refused
-- attempt; with the default thresholds (50 changed rows, plus a fifth of
-- the table's rows for a VACUUM, a tenth for an ANALYZE) autovacuum
-- visited them about once a minute in the bench, and the handovers after
-- it made the tail of its transfers. Here the thresholds are 10,000
-- changed rows (the scale factors stay): for a table of 300 rows, a VACUUM
-- after 10,060 changed rows rather than 110, 90 times rarer; for one of
-- 10,000 rows, 6 times rarer. Their updates change no indexed
-- column, and fillfactor 50 leaves each page room for new versions (on
-- pages written from now on: see "The lease table" in the package
-- documentation), so the updates are heap-only (HOT) and the next access
-- to a page prunes the dead versions without VACUUM, as far as no older
-- snapshot still needs them. Inserts (a candidate's first attempt, or its
-- first after it led) still count toward PostgreSQL's own insert
-- threshold (1,000 rows, PostgreSQL 13 and later), and autovacuum still
-- runs to prevent transaction ID wraparound. A manual VACUUM is harmless:
-- it costs each session's next statement its planning.
--
-- {{advisory_table}} and {{candidate_table}} are replaced by the quoted,
-- schema-qualified table names.
ALTER TABLE {{advisory_table}}
    SET (autovacuum_vacuum_threshold = 10000, autovacuum_analyze_threshold = 10000, fillfactor = 50);
ALTER TABLE {{candidate_table}}
    SET (autovacuum_vacuum_threshold = 10000, autovacuum_analyze_threshold = 10000, fillfactor = 50);
