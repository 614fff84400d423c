-- Candidates in the order they came: each entry of the candidate table
-- records since when its candidate has campaigned without a break (its
-- entry neither withdrawn nor run out). A plain release wakes first the
-- candidate of the highest priority that has campaigned the longest, as a
-- queue would, rather than the one that happened to enlist last: most
-- often a process that had only just started campaigning. Rows enlisted
-- before this migration count from when it ran.
--
-- {{candidate_table}} is replaced by the quoted, schema-qualified table
-- name.
ALTER TABLE {{candidate_table}}
    ADD COLUMN IF NOT EXISTS since timestamptz NOT NULL DEFAULT now();
