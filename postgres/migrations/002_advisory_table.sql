-- The advisory strategy's table: one row per election name, holding the
-- fencing term and who was last granted the lock.
--
-- The lock itself is a PostgreSQL session advisory lock on key; the row only
-- records the term (bumped in the statement that takes the lock) and the
-- holder, for display and for Renew and Release to check. holder_pid is the
-- backend that holds the lock; a row whose holder_pid holds no lock on key is
-- not held. key is unique, so two names that hash to one key are caught at
-- the second name's first grant instead of silently sharing a lock.
--
-- {{advisory_table}} is replaced by the quoted, schema-qualified table name.
CREATE TABLE IF NOT EXISTS {{advisory_table}} (
    name         text        PRIMARY KEY,
    key          bigint      NOT NULL UNIQUE,
    term         bigint      NOT NULL CHECK (term > 0),
    holder_token text,
    holder_id    text        NOT NULL DEFAULT '',
    holder_pid   integer,
    ttl          interval,
    acquired_at  timestamptz,
    CHECK ((holder_token IS NULL) = (holder_pid IS NULL))
);
