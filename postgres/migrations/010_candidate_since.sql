-- Candidates in the order they came: each entry of the candidate table
-- records since when its candidate has campaigned without a break (its
-- entry neither withdrawn nor run out), and when it was last enlisted. A
-- plain release wakes first, among the candidates of the highest priority
-- enlisted within the last half of their entry's life (within 1.5 TTLs
-- for an Elector's), the one that has campaigned the longest, as a queue
-- would, rather than the one that happened to enlist last: most often a
-- process that had only just started campaigning. Among those, the
-- candidates that attempted on their own lately (session_at) come first:
-- an advisory candidate that only shared others' attempts has no session
-- of its own, and would open one before its attempt. Rows enlisted before
-- this migration count from when it ran. Clients of an older version
-- neither keep nor restart since, nor remove a releasing holder's entry:
-- until every client is upgraded, the candidate named first may be one
-- that is not the longest waiting.
--
-- {{candidate_table}} is replaced by the quoted, schema-qualified table
-- name.
ALTER TABLE {{candidate_table}}
    ADD COLUMN IF NOT EXISTS since        timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN IF NOT EXISTS refreshed_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN IF NOT EXISTS session_at   timestamptz;
