-- The lease table: one row per election name.
--
-- Rows are never deleted: a release or an expiry keeps the row and its term,
-- so the next grant is term + 1 and terms never go back (DESIGN.md
-- invariant 2). holder_token is NULL while the lease is free (never granted
-- rows do not exist). Every time is read on the database server's clock.
--
-- Every renewal rewrites its row, and a process that holds many names
-- renews them all at once: fillfactor 50 leaves each page room for the
-- new versions of its rows, so that renewals are heap-only (HOT) updates,
-- which write no index entry and whose dead versions the next access to
-- the page prunes. CREATE TABLE IF NOT EXISTS leaves an existing table as
-- it is: see "The lease table" in the package documentation.
--
-- {{table}} is replaced by the quoted, schema-qualified table name. Every
-- statement here must be safe to run again on a database that already has
-- it: Migrate runs all of them every time.
CREATE TABLE IF NOT EXISTS {{table}} (
    name         text        PRIMARY KEY,
    term         bigint      NOT NULL CHECK (term > 0),
    holder_token text,
    holder_id    text        NOT NULL DEFAULT '',
    acquired_at  timestamptz,
    renewed_at   timestamptz,
    expires_at   timestamptz,
    CHECK ((holder_token IS NULL) = (expires_at IS NULL))
) WITH (fillfactor = 50);
