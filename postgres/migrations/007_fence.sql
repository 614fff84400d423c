-- The fence function: a leader's transaction in this database calls it with
-- the election name and the term it was granted, and commits only if that
-- term still held the name's lease when it was called (see "Fenced writes"
-- in the package documentation, and Fence). Programs in any language call
-- it, such as the leader command's children, which know LEADER_NAME and
-- LEADER_TERM:
--
--   BEGIN; SELECT leader_leases_fence('nightly-report', 7); INSERT ...; COMMIT;
--
-- It locks the name's row of the strategy table FOR KEY SHARE, so that no
-- claim can move the name to the other strategy, then the lease row of the
-- name's strategy FOR SHARE, so that no grant can take it over (but for a
-- staged release, below), both until the transaction ends; and only then
-- judges the lease, on the server's
-- clock, as the row's last committed version has it: held under term,
-- unexpired (its own expiry or its heartbeat's) for the lease strategy, its
-- lock held by the backend the row names for the advisory one. Otherwise it
-- raises SQLSTATE LF001, which aborts the transaction. It never writes. It
-- is not STRICT: a NULL argument is refused like any term that does not
-- hold the lease.
--
-- A staged release (see "Staged handovers" in the package documentation)
-- holds the lease row's lock, its update not yet committed, from before
-- the old leader's OnDemoted until its commit: a fenced write of the old
-- leader, which its OnDemoted may wait for, must not wait for that lock.
-- The release holds the name's staged lock from once its update is made
-- until its COMMIT, and takes the name's fence lock just before the
-- COMMIT. So when the staged lock is taken, the function takes the fence
-- lock in shared mode (waiting only for a commit under way), and if the
-- staged lock is still taken then, the release has not committed and
-- cannot until this transaction ends: it judges the row's committed
-- version, locked FOR SHARE if it is not locked by an update (SKIP LOCKED;
-- which, in a REPEATABLE READ transaction whose snapshot is older than a
-- committed update, fails with SQLSTATE 40001 as FOR SHARE does), and
-- otherwise FOR KEY SHARE, which an update that keeps the name does not
-- conflict with; and every grant statement takes the fence lock once it
-- has written the row, so that it too commits after this transaction,
-- however the staged release ends (committed, or rolled back). A later
-- call in the same transaction judges the same way (a transaction-local
-- setting remembers it). Holding the staged lock in shared mode otherwise,
-- it keeps any release from being staged until the transaction ends (the
-- release only tries the lock, and is then committed unstaged).
--
-- The heartbeat row is read, not locked: every grant writes the lease row
-- (the lock above makes it wait), and a lock there would hold up the
-- renewal of every lease under the heartbeat.
--
-- SECURITY INVOKER: it runs with the caller's privileges, and row locks
-- need UPDATE on the tables (the stores' role has it). PostgreSQL lets
-- PUBLIC execute a new function; CREATE OR REPLACE keeps its grants.
--
-- {{fence_function}}, {{table}}, {{heartbeat_table}}, {{advisory_table}}
-- and {{strategy_table}} are replaced by the quoted, schema-qualified names;
-- {{fence_quote}} by a dollar quote that none of the names contains.
CREATE OR REPLACE FUNCTION {{fence_function}}(name text, term bigint) RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY INVOKER
AS {{fence_quote}}
#variable_conflict use_column
DECLARE
    found_strategy text;
    found_term     bigint;
    found_held     boolean;
    staged         boolean := false;
    judged_staged  text := 'leader.fence_' || to_hex({{fence_key}});
BEGIN
    SELECT s.strategy INTO found_strategy
    FROM {{strategy_table}} AS s WHERE s.name = $1
    FOR KEY SHARE OF s;

    IF coalesce(current_setting(judged_staged, true), '') = 'on' THEN
        -- An earlier call in this transaction judged the name while a
        -- release was staged, and holds the fence lock, which every grant
        -- waits for: judged as then, whatever became of that release (a
        -- FOR SHARE now would wait for a grant that waits for this
        -- transaction).
        staged := true;
    ELSIF NOT pg_try_advisory_xact_lock_shared({{staged_key}}) THEN
        PERFORM pg_advisory_xact_lock_shared({{fence_key}});
        staged := NOT pg_try_advisory_xact_lock_shared({{staged_key}});
        IF staged THEN
            PERFORM set_config(judged_staged, 'on', true);
        END IF;
    END IF;

    IF found_strategy = 'lease' THEN
        IF NOT staged THEN
            PERFORM FROM {{table}} AS l WHERE l.name = $1 FOR SHARE OF l;
        ELSE
            PERFORM FROM {{table}} AS l WHERE l.name = $1 FOR SHARE OF l SKIP LOCKED;
            IF NOT FOUND THEN
                PERFORM FROM {{table}} AS l WHERE l.name = $1 FOR KEY SHARE OF l;
            END IF;
        END IF;
        SELECT l.term, l.holder_token IS NOT NULL AND (CASE WHEN l.heartbeat IS NULL THEN l.expires_at
                ELSE coalesce((SELECT h.expires_at FROM {{heartbeat_table}} AS h WHERE h.id = l.heartbeat AND NOT h.dead), '-infinity')
            END) > clock_timestamp()
        INTO found_term, found_held
        FROM {{table}} AS l WHERE l.name = $1;
    ELSIF found_strategy = 'advisory' THEN
        IF NOT staged THEN
            PERFORM FROM {{advisory_table}} AS a WHERE a.name = $1 FOR SHARE OF a;
        ELSE
            PERFORM FROM {{advisory_table}} AS a WHERE a.name = $1 FOR SHARE OF a SKIP LOCKED;
            IF NOT FOUND THEN
                PERFORM FROM {{advisory_table}} AS a WHERE a.name = $1 FOR KEY SHARE OF a;
            END IF;
        END IF;
        SELECT a.term, a.holder_token IS NOT NULL AND EXISTS (
                SELECT FROM pg_locks AS k
                WHERE k.locktype = 'advisory'
                    AND k.database = (SELECT d.oid FROM pg_database AS d WHERE d.datname = current_database())
                    AND k.classid::bigint = ((a.key >> 32) & 4294967295) AND k.objid::bigint = (a.key & 4294967295)
                    AND k.objsubid = 1 AND k.mode = 'ExclusiveLock' AND k.granted AND k.pid = a.holder_pid)
        INTO found_term, found_held
        FROM {{advisory_table}} AS a WHERE a.name = $1;
    END IF;

    IF $2 IS NOT NULL AND found_term = $2 AND found_held THEN
        RETURN;
    END IF;
    RAISE EXCEPTION USING
        ERRCODE = 'LF001',
        MESSAGE = format('term %s does not hold the lease of election %L', coalesce($2::text, 'NULL'), $1),
        DETAIL = CASE
            WHEN found_strategy IS NULL THEN 'The election has no row in the strategy table: it was never granted, or last granted by a version from before that table.'
            WHEN found_term IS NULL THEN format('The election has no lease under its strategy (%s).', found_strategy)
            WHEN found_held THEN format('Term %s holds it now (%s strategy).', found_term, found_strategy)
            ELSE format('Its last term is %s, which holds it no longer (%s strategy: released, run out or its holder gone).', found_term, found_strategy)
        END,
        HINT = 'Roll back the transaction: this term has ended, and another instance may lead.';
END
{{fence_quote}};
