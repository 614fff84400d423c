-- Heartbeats of the lease strategy: a process renews all the leases it
-- holds with one TTL by renewing one row here (see "Heartbeats" in the
-- package documentation).
--
-- A lease row whose heartbeat column names a row here is held while that
-- row is unexpired and not dead; its own expires_at is then 'infinity', so
-- that a client of an earlier version, which knows nothing of heartbeats,
-- never takes it over. A heartbeat is renewed only while it is unexpired
-- and not dead, and the statement that takes over a lease from an expired
-- heartbeat marks it dead, so it can never come back to life.
--
-- A process makes a new heartbeat (a random id) per store and TTL each
-- time it starts, and one row is a few dozen bytes; each new heartbeat
-- deletes those of processes long gone (see beatStatements.insert).
--
-- {{heartbeat_table}} is replaced by the quoted, schema-qualified table
-- name, {{table}} by the lease table's, {{heartbeat_index}} by the quoted
-- name of the lease table's index on its heartbeat column.
CREATE TABLE IF NOT EXISTS {{heartbeat_table}} (
    id         text        PRIMARY KEY,
    expires_at timestamptz NOT NULL,
    dead       boolean     NOT NULL DEFAULT false
);
ALTER TABLE {{table}} ADD COLUMN IF NOT EXISTS heartbeat text;
CREATE INDEX IF NOT EXISTS {{heartbeat_index}} ON {{table}} (heartbeat);
