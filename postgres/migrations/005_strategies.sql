-- One strategy per election name: the lease and advisory strategies keep
-- their leases in tables of their own, so without this table a candidate
-- of each could both be granted one name (see "One strategy per name" in
-- the package documentation).
--
-- A row says which strategy name is elected with. Every grant, of either
-- strategy, locks its name's row (FOR KEY SHARE) and grants only if the
-- row names its own strategy; a candidate that finds no row, or the other
-- strategy's, claims the name in a transaction of its own (claimStrategy)
-- that locks the row FOR UPDATE and only then, in a later statement (so
-- with a snapshot taken after the lock), looks at the other strategy's
-- lease: the name moves only while nobody holds it there and nobody has for
-- a TTL. term_floor is the other strategy's last term when the name moved,
-- which every grant stays above, so terms grow per name across strategies.
-- idle_seen_at is when a claim first found the other strategy's last holder
-- gone without a release (its session ended), whose end time is unknown.
--
-- released_at, in the two lease tables, is when a lease was last
-- released: a claim waits a TTL after it.
--
-- {{strategy_table}}, {{table}} and {{advisory_table}} are replaced by the
-- quoted, schema-qualified table names.
CREATE TABLE IF NOT EXISTS {{strategy_table}} (
    name         text        PRIMARY KEY,
    strategy     text        NOT NULL CHECK (strategy IN ('lease', 'advisory')),
    since        timestamptz NOT NULL,
    term_floor   bigint      NOT NULL DEFAULT 0 CHECK (term_floor >= 0),
    idle_seen_at timestamptz
);
ALTER TABLE {{table}} ADD COLUMN IF NOT EXISTS released_at timestamptz;
ALTER TABLE {{advisory_table}} ADD COLUMN IF NOT EXISTS released_at timestamptz;
