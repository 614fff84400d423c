-- Transfers: handing a lease to a chosen candidate (leader.Transferer; see
-- "Transfers" in the package documentation).
--
-- Both lease tables gain, per name:
--
--   priority, reason  the holder's priority and why its grant was made
--                     ('' for a first grant or the holder's own,
--                     'release', 'expiry', 'transfer', 'priority'), written
--                     by every grant.
--   request_*         a pending request that the holder hand over: the
--                     candidate ID asked for ('' for the best), its reason,
--                     and until when it is pending. Written by
--                     RequestTransfer while the lease is held; cleared by
--                     every grant and release.
--   successor_*,      a released lease reserved for one candidate's token
--   reserved_until    (its ID and the reason its grant will record) until
--                     reserved_until: written by ReleaseTo, cleared by every
--                     grant and release. Meanwhile only that token is
--                     granted the lease.
--
-- None of them is indexed but by {{request_index}}, a partial index on the
-- lease table's heartbeat column for the rows with a request: a heartbeat
-- round reads the requests of the leases under it there, without reading
-- every lease row under the heartbeat. Renewals write none of these
-- columns, so they stay heap-only (HOT) updates.
--
-- The candidate table holds, per name, the candidates that campaign for it
-- (Enlist), each until its entry expires on the server's clock; both
-- strategies use it.
--
-- {{table}}, {{advisory_table}} and {{candidate_table}} are replaced by the
-- quoted, schema-qualified table names, {{request_index}} by the quoted
-- name of the index.
ALTER TABLE {{table}}
    ADD COLUMN IF NOT EXISTS priority         integer NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS reason           text    NOT NULL DEFAULT '',
    ADD COLUMN IF NOT EXISTS request_to       text,
    ADD COLUMN IF NOT EXISTS request_reason   text,
    ADD COLUMN IF NOT EXISTS request_until    timestamptz,
    ADD COLUMN IF NOT EXISTS successor_token  text,
    ADD COLUMN IF NOT EXISTS successor_id     text,
    ADD COLUMN IF NOT EXISTS successor_reason text,
    ADD COLUMN IF NOT EXISTS reserved_until   timestamptz;
ALTER TABLE {{advisory_table}}
    ADD COLUMN IF NOT EXISTS priority         integer NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS reason           text    NOT NULL DEFAULT '',
    ADD COLUMN IF NOT EXISTS request_to       text,
    ADD COLUMN IF NOT EXISTS request_reason   text,
    ADD COLUMN IF NOT EXISTS request_until    timestamptz,
    ADD COLUMN IF NOT EXISTS successor_token  text,
    ADD COLUMN IF NOT EXISTS successor_id     text,
    ADD COLUMN IF NOT EXISTS successor_reason text,
    ADD COLUMN IF NOT EXISTS reserved_until   timestamptz;
CREATE INDEX IF NOT EXISTS {{request_index}} ON {{table}} (heartbeat) WHERE request_until IS NOT NULL;
CREATE TABLE IF NOT EXISTS {{candidate_table}} (
    name       text        NOT NULL,
    token      text        NOT NULL,
    id         text        NOT NULL,
    priority   integer     NOT NULL,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (name, token)
);
