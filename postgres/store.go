// Package postgres holds the PostgreSQL stores, for Electors on many hosts
// that share a database, and the Router, which delivers messages sent by any
// instance to the current leader only.
//
// # Two strategies
//
// [LeaseStore], the lease strategy and the default, keeps a lease with an
// expiry in a table row. A leader that vanishes is replaced once its lease
// runs out (the TTL); a graceful release hands over at once. It needs no
// session state, so it works behind transaction-pooling proxies too.
//
// [AdvisoryStore], the advisory strategy, holds a session advisory lock on a
// connection of its own. A leader whose process dies is replaced as soon as
// the server notices the closed connection (milliseconds on a LAN), without
// waiting for a TTL; one that vanishes silently is replaced once the server
// ends its idle session, a TTL after its last heartbeat. It needs
// PostgreSQL 14 or later and a direct connection. See its documentation
// for what it does when the server itself ends the holder's session.
//
// Both grow a fencing term at every grant, judge time on the server's clock
// or the server's own timers, send wake-ups with NOTIFY, and pass the
// conformance suite (leadertest.TestStore). [Migrate] creates the tables of
// both and the Router's.
//
// # One strategy per name
//
// A name is elected with one strategy at a time, and the stores enforce it:
// the strategy table (Options.StrategyTable, by default
// public.leader_strategies) records each name's strategy, every grant locks
// the name's row there and grants only under its own strategy, and a
// candidate of the other strategy is refused with a [*StrategyConflictError],
// which names the name and both strategies, while the name's lease is held
// under the strategy that has it (the error then wraps [leader.ErrPermanent],
// so that an Elector's Run returns it at once), or was held or released
// there within the last TTL (the Elector then tries again, and is granted
// the name once the TTL has passed). A fleet half-way through a
// change of strategy, or a typo in one instance's configuration, is loud
// and never elects twice. Terms stay unique and growing per name across
// strategies: a name that moves keeps counting from the other strategy's
// last term.
//
// To move a name from one strategy to the other, stop every candidate of
// the old strategy, then start the new ones: they are granted the name a
// TTL after the old leader released it (or, for an advisory leader that
// went without a release, a TTL after a new candidate first saw it gone).
// [StrategyOf] tells which strategy a name uses.
//
// # Fenced writes
//
// The Elector ends a leader's belief before its lease could end (DESIGN.md
// invariant 1), but a process paused past its lease (SIGSTOP, a VM pause, a
// long stall) or a write delayed on its way can still reach the database
// after another instance was elected. Writes to the election's own
// database can be made exactly safe: the leader's transaction calls
// [Fence] with the term it was elected under ([leader.TermFrom] of the
// leader context), and commits only if that term held the lease when
// Fence ran; then no later term can be granted until the transaction
// ends, so its writes land before the next leader's, or never. Otherwise
// Fence returns an error wrapping [leader.ErrLeaseLost], and the server
// has aborted the transaction.
//
//	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
//		term, _ := leader.TermFrom(ctx)
//		if err := postgres.Fence(ctx, tx, postgres.Options{}, "nightly-report", term); err != nil {
//			return err // the term is over: rolled back
//		}
//		_, err := tx.Exec(ctx, "INSERT INTO reports ...")
//		return err
//	})
//
// Fence calls a function that [Migrate] creates beside the lease table
// (by default public.leader_leases_fence(name text, term bigint); see
// [FenceFunction]), which programs in any language call the same way,
// such as the children of the leader command, which know only LEADER_NAME
// and LEADER_TERM (psql's variables quote the name; -c "BEGIN; SELECT
// leader_leases_fence('$LEADER_NAME', $LEADER_TERM); ...; COMMIT;" does
// the same for a name without quotes):
//
//	psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -v name="$LEADER_NAME" -v term="$LEADER_TERM" <<'SQL'
//	BEGIN;
//	SELECT leader_leases_fence(:'name', :term);
//	INSERT INTO reports ...;
//	COMMIT;
//	SQL
//
// It raises SQLSTATE LF001 ([FenceSQLState]) when the term does not hold
// the lease. It works for both strategies. It holds the name's row locks
// until the transaction ends, so that a takeover waits for it: keep fenced
// transactions short, and fence one name per transaction. See Fence for
// why it is safe, and for what a failover to an asynchronous standby does
// to it.
//
// # Transfers
//
// Both stores implement [leader.Transferer], so that a leader hands its
// lease to a chosen candidate ([leader.Elector.Transfer],
// [leader.RequestTransfer], leader.Config.Priority). Followers are
// enlisted in the candidates' table that both strategies share (by
// default public.leader_leases_candidates), the entry expiring on the
// server's clock: an Acquire that does not grant upserts its candidate's
// entry in the statement that refuses it (committed without waiting for
// a WAL flush; a grant writes none), and Enlist, one upsert, serves a
// follower whose attempts are further apart; a withdrawal deletes the
// name's expired entries too. A request to hand over is recorded on the
// lease's row while the lease is held, and read by the holder's next
// renewal in the statement it sends anyway: Renew, or the heartbeat round
// of RenewBatch, which finds the requests of the leases under its
// heartbeat through a partial index.
//
// ReleaseTo is a release, in one round trip, that also records on the row
// the successor's token, and until when the lease is reserved for it, on
// the server's clock; it wakes the followers as a release does (a NOTIFY;
// for the advisory strategy, the lock waiters see the holder's mark
// freed). While the reservation lasts, only the successor's token is
// granted the lease, with the next term and the handover's reason; any
// other candidate is refused and told Lease.Successor and Reserved. A
// candidate whose statement's snapshot shows the lease reserved for
// another is refused without locking the lease row (lease strategy) or
// trying the lock (advisory strategy), so that the followers woken with
// the successor never delay its grant (the lease strategy refuses so a
// lease that another token holds in the snapshot, too: see One statement
// per operation), which takes one round trip: the
// leaderless gap of a handover is two round trips and a wake-up. A
// reservation that commits after a candidate's snapshot is judged on the
// row as it stands once locked; an advisory candidate that took the lock
// meanwhile lets it go without a grant, and looks again. Every grant
// records the candidate's priority and why it was made (Lease.Reason: a
// released row gives release, a row whose holder went without one
// expiry, a reservation its reason), and clears the request and the
// reservation. A handover is a release and then a grant: the old term
// ends before the new one starts, and the strategy table, the epochs'
// grace and the fence judge the successor's grant as any other. Clients
// of versions before transfers ignore reservations and leave them on the
// row: upgrade them all before relying on handovers.
//
// # Prepared handovers
//
// The LeaseStore also implements [leader.HandoverPreparer], with which the
// Elector prepares each handover while it still leads, so that the
// successor waits on the server and its grant runs as the release
// commits: the leaderless gap is then the release's round trip and the
// successor's statement, without a notification or a round trip of the
// successor's between them. PrepareHandover takes, on a connection that
// it keeps (from a second small pool of the store's own, for prepared
// handovers and the notices sent later, so that neither ever holds up
// renewals and releases; see Options.MaxConns), a session-level advisory lock whose two int4 keys
// are 1724485689 (the first 4 bytes of the SHA-256 of "leader:handover")
// and a hash of the table and the name, and sends a NOTIFY whose payload
// names the successor's token ("~p"). The successor's store, told by its
// listener, wakes the successor's follower alone; its next Acquire sends,
// in one round trip, a transaction that waits for that lock in shared
// mode (pg_advisory_xact_lock_shared, bounded by lock_timeout: a quarter
// of its TTL, and never past half of what its context leaves) and then
// runs a grant statement whose snapshot shows the release: the acquire
// statement cut down to the case it expects, a released lease not
// reserved for another candidate, which it grants as the acquire
// statement would (with the reservation's reason, or 'release'). Commit
// sends the release of ReleaseTo and then, in a transaction of its own,
// the unlock, in one round trip; when the successor waited, the release
// neither sends its NOTIFY, nor looks for a candidate to name in one, nor
// removes the holder's own entry among the candidates: the NOTIFY is sent
// only 5 ms later, by the same round trip, and only if the lease is still
// free (a NOTIFY wakes the backend and the process of every listener,
// which would compete for the CPU with the successor's grant), and the
// entry is removed after it.
// The grant, like every grant, sends its NOTIFY 5 ms later (see
// Wake-ups). Both sides have the server plan their
// statements before the commit, outside any transaction, under
// plan_cache_mode force_generic_plan (an EXPLAIN of the prepared
// statement, which keeps the plan; the store's connections for prepared
// handovers keep the setting), so that neither plans nor reads the
// catalog between the release and the grant. Under the simple protocol
// (default_query_exec_mode=simple_protocol) the successor's statement
// is not prepared, and is planned after the release.
// PrepareHandover returns once the
// successor waits (it looks in pg_locks every millisecond), or after the
// wait it was given.
//
// The lease's row is not locked: the lease stays held and renewable while
// the handover is prepared, and other candidates are not held up. The
// grant is judged on the row, on the acquire statement's terms, so a
// preparation changes when the successor tries, never what it is granted;
// when the grant statement finds anything but the reservation, it grants
// nothing, and the successor runs the acquire statement at once.
// An Abort, or the preparer's session ending (its process killed), lets
// the successor's statement run at once, and it finds the lease still
// held; a preparer that stalls (paused) holds it up for its lock_timeout,
// after which it is an ordinary attempt. A successor that dies while it
// waits is noticed by the server within 100 ms
// (client_connection_check_interval, PostgreSQL 14 and later), and its
// statement is cancelled; one that dies (or is paused) in the last moments
// before the commit may still be granted the lease, which then runs out
// after its TTL, where a handover without preparation would leave it to
// the others after its reservation. A preparation needs a session of
// its own: behind a transaction-pooling proxy PrepareHandover fails, and
// the Elector hands over with ReleaseTo. Close aborts the preparations
// not yet ended. The advisory strategy prepares handovers too, on the
// holder's own session (see "Handovers" in the AdvisoryStore's
// documentation).
//
// # Staged handovers
//
// A prepared handover whose successor waits is staged
// ([leader.HandoverStager]), on both stores: once the old leader's tenure
// has ended and before its OnDemoted runs, the preparation's connection
// (the LeaseStore's) or the holder's session (the AdvisoryStore's) runs
// the release, which grants the successor the lease, in a transaction
// that it leaves open, and the commit after OnDemoted only takes a lock,
// unlocks and commits. The release's work is then done while the old
// term's work winds down, out of the leaderless gap; the LeaseStore's
// successor then only reads the row that names it. Nobody sees the
// release before the commit: the row (and the lock) name the holder. The
// LeaseStore's grant has the holder's TTL (the successor's first renewal
// puts its own), so it stages only a lease whose TTL it knows: one it
// granted or renewed; a successor whose own TTL is longer does not claim
// it, and is granted the lease again, for its TTL, under the term after. The Elector stages only when no renewal of the lease
// is in flight, since a renewal may write the row that the staged release
// holds locked.
//
// No notice tells of a staged grant: the successor learns of it by waiting.
// A LeaseStore stages only while the successor still waits for the
// handover, checked once the release has locked the row; a successor whose
// wait runs out after that waits for the row's lock instead (its attempt
// does not refuse from its snapshot, as others' do), and finding the lease
// its own once the release commits, is granted it again under the term
// after (a first grant's reason, not the handover's); and one whose
// attempt ends with its context leaves the preparation to its next.
//
// Such a transaction holds the lease row's lock from before OnDemoted to
// after it, where the old leader's fenced writes (see Fence), which
// OnDemoted may wait for, lock the row too. Two transaction-level advisory
// locks of each name, in the bigint key space, keep them apart. Their keys
// are the first 8 bytes of the SHA-256 of "leader:staged:" (or
// "leader:fence:"), the lease table's quoted, schema-qualified name, a
// colon and the election name. The staged release takes the staged lock,
// never waiting for it, once its update is made, and the fence lock just
// before its COMMIT. The fence function, finding the staged lock taken,
// takes the fence lock in shared mode, and judges the row's committed
// version without waiting for the release's lock: the release's commit
// then waits for the fenced transaction, whose writes land before the
// successor's. A fenced transaction that began before the staging holds
// the staged lock in shared mode, and the release is then not staged,
// but committed after OnDemoted as before; nor is it when its update
// would wait for a row lock (10 ms), or when the schema's fence function
// is older than staged releases (run Migrate). A commit later than half
// of the reservation after the staging makes the release afresh, so that
// the reservation has half of its length to run at least.
//
// # Connection poolers
//
// A transaction-pooling proxy such as PgBouncer cannot keep session state
// (see [ErrPooledSession]). Behind one, the LeaseStore keeps working but
// says in a warning that its wake-ups are off, and followers take over at
// the lease's expiry; the AdvisoryStore and the Router refuse to start.
// Connect pgx to PgBouncer 1.20 or older with default_query_exec_mode=exec
// (or simple_protocol) in the connection string.
//
// # Privileges
//
// Only Migrate creates anything: run it as a role that may create the
// schema (if missing) and tables in it, such as the tables' owner at
// deploy time. The stores and the Router need no superuser, no right to
// create anything and no statistics role; with the default Options the
// role they run as needs only:
//
//	GRANT CONNECT ON DATABASE app TO leader_app;
//	GRANT USAGE ON SCHEMA public TO leader_app;
//	GRANT SELECT, INSERT, UPDATE ON public.leader_leases, public.leader_advisory, public.leader_strategies TO leader_app;
//	GRANT SELECT, INSERT ON public.leader_leases_epochs TO leader_app;
//	GRANT SELECT, INSERT, UPDATE, DELETE ON public.leader_heartbeats TO leader_app;
//	GRANT SELECT, INSERT, UPDATE, DELETE ON public.leader_leases_candidates TO leader_app;
//	GRANT SELECT, INSERT, UPDATE, DELETE ON public.leader_messages TO leader_app;
//
// The candidates' table (see Transfers) is both strategies'. The message
// table's identity sequence needs no grant, and LISTEN,
// NOTIFY, advisory locks, pg_locks and pg_stat_activity need none. Nor
// does the fence function (see Fenced writes), which PostgreSQL lets
// PUBLIC execute; where the database's default privileges revoke that:
//
//	GRANT EXECUTE ON FUNCTION public.leader_leases_fence(text, bigint) TO leader_app;
//
// It runs with its caller's privileges, and its row locks need UPDATE on
// the tables above: a role that fences, such as a leader command's child
// logged in as a role of its own, needs USAGE on the schema and SELECT,
// UPDATE on leader_leases, leader_heartbeats, leader_advisory and
// leader_strategies.
// Migrate run as such a role does nothing on an up-to-date schema, but
// fails with SQLSTATE 42501 ("permission denied for schema public") on one
// that needs a change, even when every table exists: PostgreSQL checks the
// CREATE privilege before IF NOT EXISTS. pg_stat_activity shows how long a
// session has been idle only to its own role, its members and
// pg_read_all_stats: run every candidate of an advisory election as one
// role, or followers are told the holder's whole TTL as Lease.Remaining
// (they are still woken at once when the holder goes). See Example
// (Privileges).
//
// # The lease table
//
// [Migrate] creates the table (by default public.leader_leases) with one row
// per election name:
//
//	name          the election name (primary key)
//	term          the fencing term of the current or last grant
//	holder_token  the holder's random per-instance token; NULL while free
//	holder_id     the holder's candidate ID, for display; '' while free
//	acquired_at   when the current holder was granted the lease
//	renewed_at    when the current holder last renewed it (or moved it
//	              under a heartbeat)
//	expires_at    when the lease runs out unless renewed; NULL while free;
//	              'infinity' while it is under a heartbeat
//	heartbeat     the heartbeat the lease is under, or NULL (see Heartbeats)
//	released_at   when the lease was last released
//	priority      the holder's priority, as granted (see Transfers)
//	reason        why the last grant was made: '', release, expiry,
//	              transfer or priority
//	request_to, request_reason, request_until
//	              a pending request that the holder hand over; NULL if none
//	successor_token, successor_id, successor_reason, reserved_until
//	              whom a handed-over lease is reserved for, and until when
//
// To see who holds each name and until when, read the view that Migrate
// creates beside it (by default public.leader_leases_status), which
// shows both strategies' leases on the server's clock, a lease under a
// heartbeat with its heartbeat's expiry:
//
//	SELECT name, strategy, holder_id, term, expires_at FROM leader_leases_status WHERE held;
//
// A monitoring role needs only GRANT SELECT on the view, and on the tables
// it reads.
//
// Rows are never deleted. A release clears the holder but keeps the term, so
// the next grant is term+1 and terms never go back (DESIGN.md invariant 2).
// The store compares tokens, never candidate IDs (invariant 3).
//
// The table is created with fillfactor 50, so that a renewal, which
// rewrites its row, finds room on the row's page: a heap-only (HOT)
// update, which writes no index entry and whose old row is pruned from the
// page without waiting for VACUUM. The pruning waits for every transaction
// that began before the row died to end, in any database of the server: a
// transaction left open holds it back, and the renewals then fill their
// pages and move to others. A table created by an earlier version has the
// default (100), where almost no renewal is HOT; ALTER TABLE ... SET
// (fillfactor = 50), then VACUUM FULL, changes it.
//
// # One statement per operation
//
// Acquire, Renew and Release are each one SQL statement, run outside any
// explicit transaction, so each is atomic on its own. (An Acquire may send
// more, each atomic on its own all the same: one that a release woke by
// name, or that waited for a prepared handover, first runs a grant statement
// cut to a released lease, which grants nothing if the lease is not so, the
// waited one in a transaction of its own after its wait; see Prepared
// handovers and Wake-ups. One that finds the name not yet the lease
// strategy's claims it and tries again; see One strategy per name.) The row
// lock taken by the statement orders concurrent calls for one name, and
// every decision is made on the row as it stands once locked (PostgreSQL
// re-reads a row changed by a transaction that committed while the statement
// waited for its lock). Acquire inserts the row or updates it only where it
// is free, expired or already held by the caller's token; when it grants
// nothing it reports the row as it stands, locked, so a follower learns the
// holder and how long the lease has left (only the losers of a race for a
// name's very first grant cannot see the winner's new row from their
// statement; they read it with a second one). A row that another token
// holds, unexpired, in the statement's snapshot is the exception: the
// statement refuses without locking it and reports it from the snapshot,
// so that a follower never waits for the row lock of a renewal or of a
// staged release (see Staged handovers) and then runs beside the
// successor that the same commit lets go. A release committed after the
// snapshot is then reported as still held; its notice wakes the follower
// for one more attempt. Renew updates only an
// unexpired row held by the token under the term, and never inserts. Release
// clears only such a row and calls pg_notify in the same statement, so the
// wake-up is sent exactly when the release commits. A new grant sends one
// too, 5 ms after it commits and only if it still holds then (see Wake-ups).
//
// Renewals are batched: the store is a [leader.BatchRenewer], so the
// Electors of a process that lead on one LeaseStore with one RenewInterval
// renew together, with one call to [LeaseStore.RenewBatch] per renew round
// and so one statement, whatever the number of names: it renews the
// store's heartbeat (see Heartbeats). Renew calls that reach the store
// together are sent as one statement too, which renews each lease on its
// own row and terms (a lease no longer held is reported lost, the others
// renewed).
//
// A follower sends one statement per TTL, on the store's own connections
// (see Options.MaxConns), which the store's pool pings before handing them
// out only when they were idle for over a minute, not after a second as
// pgxpool does by default: an attempt is one round trip, and so is a
// successor's grant after a handover. A connection that the server closed
// meanwhile fails one call, which the Elector retries. A pool given to
// the store whose Config.ShouldPing is set keeps its own rule.
//
// # Heartbeats
//
// A process that leads 10,000 names would otherwise rewrite 10,000 rows
// per renew round. Instead, [LeaseStore.RenewBatch] keeps a heartbeat per
// TTL: a row of the heartbeat table (by default public.leader_heartbeats)
// with a random id, an expiry and a dead flag. Its first round for a lease
// moves the lease under the heartbeat (the lease row names it, and its own
// expires_at becomes 'infinity'), in the statement that renews the
// heartbeat; from then on a round renews the heartbeat's row alone, and
// moves only the leases new to it.
//
// A lease under a heartbeat is held while the heartbeat is unexpired and
// not dead, and every statement that judges a lease judges it so. The
// invariants hold as for a lease on a row of its own:
//
//   - A heartbeat is renewed only while it is unexpired and not dead, for
//     ttl from the server's now, so a lease under it stays held for at
//     least the TTL its Elector counts its deadline from.
//   - Acquire takes a lease over from an expired heartbeat only by marking
//     the heartbeat dead in the same statement. That is an UPDATE of the
//     heartbeat's row, so it waits for a renewal of it under way and then
//     finds it unexpired (and takes nothing), or it goes first, and the
//     renewal, waiting for it, finds the heartbeat dead. A dead heartbeat
//     is never renewed again, even if the server's clock steps back. Its
//     holder's next round reports every lease under it lost.
//   - Only the store that owns a heartbeat moves leases under it, one
//     statement at a time; a grant (to the same token too), a release and
//     a Renew take the lease out from under it. Each round counts the
//     leases under the heartbeat, and if the count is not what the store
//     expects (a lease left it behind the store's back, say released
//     through another store), it asks which of its leases are still there,
//     reports the others lost, and takes out from under the heartbeat any
//     lease it no longer renews (the lease keeps the heartbeat's expiry as
//     its own).
//
// The store makes a new heartbeat when it first renews with a TTL, and
// after one died. There is one heartbeat row per store, TTL and process
// start, a few dozen bytes each; each new heartbeat deletes those of
// processes long gone (expired for a minute, with no lease row naming
// them), so the table stays the size of the live processes. A lease under a heartbeat
// expires at 'infinity' on its row, so a client of a version before
// heartbeats never takes it over (it cannot see the heartbeat expire):
// upgrade every client of a lease table before relying on takeovers of
// leases that upgraded ones held.
//
// # Durability
//
// A grant or a renewal that the server acknowledged and then lost in a
// crash would break the invariants: a lost grant hands its term out again,
// and a lost renewal ends a lease before its holder's local deadline. So the
// statements that grant or renew (of both strategies) commit durably even
// where the session's synchronous_commit is off: they raise it to 'local'
// for their own transaction (a stronger setting, such as one that waits for
// standbys, is kept). Releases are left alone: a lost release only lets the
// lease run out. A failover to an asynchronous replica can still lose the
// last commits, which no client can prevent; see Failover for how the
// stores stay safe then.
//
// # Failover
//
// Production PostgreSQL is often a primary with a streaming standby that
// a manager (Patroni, pg_auto_failover, CloudNativePG, a cloud's HA)
// promotes when the primary's host is gone. Give the stores every host,
// in any order, and let libpq's rules pick the writable one:
//
//	postgres://app@db1:5432,db2:5432/app?target_session_attrs=read-write&connect_timeout=2
//
// target_session_attrs=read-write is needed: without it a connection may
// land on a standby, where grants fail with leader.ErrReadOnly. pgx tries
// the hosts in turn, each for connect_timeout (seconds); the stores' own
// connections use DefaultConnectTimeout (5 s) when it is not set, where
// pgx, and so the pool given to them (which Migrate and Fence use), would
// wait for as long as a silent host holds the connection. Keep
// it short, but above a connection's set-up time (TLS and authentication
// included): 2 to 5 seconds. Client TCP keepalives are not needed: every
// store call has a deadline, and a call cut short closes its connection.
// (libpq's keepalives parameters are not pgx's: in the connection string
// pgx sends them to the server as settings, which it refuses;
// tcp_user_timeout and tcp_keepalives_idle there set the server's side of
// the connection, which the advisory strategy sets on its sessions
// itself.)
//
// When the primary's host vanishes without a FIN or RST, its leader steps
// down by its local deadline, as for any store it cannot reach, and the
// candidates reach the promoted server whichever host the connection
// string lists first, although each of their calls is shorter than a
// connect timeout. A store opens its own connections (its pool's, and an
// advisory store's sessions, lock waiters and wake-up listener) in the
// background, never within a call's deadline, and it remembers how each
// host did: it tries first the hosts that answered as a primary (or were
// never tried), then those that answered as standbys, and last those that
// did not answer in time, or on which a call of the store's was cut short.
// A candidate's calls meet the vanished host within about a TTL (every
// follower calls once per TTL at least), after which its new connections
// go to the other hosts first; only a connection that tries the vanished
// host before that, such as one of a process started after the failover
// whose connection string lists that host first, or one being opened as
// the host vanished, waits out a connect timeout there, once.
//
// A promoted asynchronous standby can lack the last grants, renewals and
// releases that the old primary acknowledged: a leader granted there
// believes it leads until its local deadline, and the new primary may not
// know its term. So every grant statement reads the server's timeline,
// which PostgreSQL bumps at every promotion, and records when a server of
// the database first answered on it (the epoch table, by default
// public.leader_leases_epochs; Migrate records the timeline it runs on).
// On a new timeline, nothing is granted (a re-grant neither) until the
// candidate's TTL has passed since then, and terms are above (timeline-1)
// << 40, so above every term the old primary handed out, lost ones
// included. What this assumes and guarantees:
//
//   - The old primary accepts no writes once the standby is promoted (the
//     manager fences it, as every HA setup must). Leases it granted were
//     granted before, and their holders' beliefs end within a TTL of
//     their last renewal, which came before the promotion.
//   - The wait is measured on the new primary's clock alone: any offset
//     between the old and the new primary's clocks is covered; their
//     rates must agree within DriftMargin, as for every lease.
//   - Candidates of a name use one TTL (a lost grant with a longer TTL
//     than the candidate's would outlast the wait).
//   - Takeover after a promotion: the TTL, counted from when the first
//     grant statement reached the promoted server, plus a follower's next
//     attempt (RetryInterval) and a round trip: 3.1 s at a 3 s TTL in the
//     tests for a candidate that first connects to the promoted server.
//     Candidates that led or followed on the vanished primary take a
//     little longer to leave it (their first call there to be cut short);
//     in the tests, with the vanished host listed first and the promotion
//     as it vanished, 5 to 7 s at a 3 s TTL. Add a connect timeout for
//     a candidate whose first connection after the failover tries the
//     vanished host (see above).
//   - With a synchronous standby nothing is lost, and the same wait is
//     made (a timeline change cannot tell the two apart).
//
// The privileges: SELECT and INSERT on the epoch table (see Privileges);
// the timeline is read with pg_walfile_name(pg_current_wal_lsn()), which
// every role may call.
//
// # The clock
//
// Every time is read with clock_timestamp() on the database server, at the
// moment the statement decides; no client's clock is ever sent or compared.
// A lease granted or renewed for ttl expires at the server's now+ttl, and the
// server's now is no earlier than the moment the caller sent the request, so
// the Elector's local deadline (sent + TTL - DriftMargin on its monotonic
// clock) always falls inside the lease the server granted (DESIGN.md
// invariant 1). Remaining is computed on the server too, as expires_at minus
// clock_timestamp(), so that followers whose wall clocks are wrong still
// sleep exactly until the expiry. TTLs are sent as intervals rounded up to
// the server's microsecond precision.
//
// # Wake-ups
//
// [LeaseStore.Watch] is served by one dedicated connection per store,
// opened from the pool's configuration (it is not taken from the pool),
// that LISTENs on Options.Channel; each notification's payload names the
// election and whether it was a grant or a release (see Options.Channel).
// [LeaseStore.WatchFree], which the Elector's followers use, skips the
// grants: a follower that raced for the lease and lost learned of the
// grant from its own attempt, so each handover costs each follower one
// attempt, not two. A grant's notification is sent 5 ms after the grant,
// by the new holder's store, and only if the lease is still held under that
// grant (then no release can follow it): sent as the grant commits, it would
// wake every listening backend and process of the database at the moment the
// new leader starts, and on a small machine they took the CPU that its first
// moments need (a graceful handover took a third longer at p50). Watch thus
// learns of a grant 5 ms late, and of none whose store closed within those
// 5 ms.
//
// A plain release wakes one candidate first: its notification names the
// candidate of the highest priority among the name's candidates (as
// Enlist and refused attempts record them) whose entry has not run out,
// those enlisted again within the last half of their entry's life (1.5
// TTLs for an Elector's, so that a killed candidate drops behind the live
// ones within 1.5 TTLs) before the others, then (AdvisoryStore) those
// that made an attempt on their own session in the last 90 s (one that
// only shared others' attempts has no session of its own, and would open
// one first) before the others, and among equals the one that
// has campaigned the longest without a break (an entry withdrawn, or run
// out, starts anew), as in a queue, never the
// releasing holder, whose own entry the release removes (a leader that
// lets go and campaigns again queues behind those that waited). A
// candidate that has only just begun to campaign, a process just started,
// is named last: its connections and listener are the least likely to be
// ready. The notification goes to that
// candidate's channel alone: Options.Channel, "~", and the first two
// hexadecimal digits of the SHA-256 of its token, one of 256 candidate
// channels, on which each store's listener also LISTENs for the
// candidates it watches for (a listener keeps the channels it added, so
// a process with many candidates ends up on most of them). So it wakes
// the process of that candidate (and of the few whose candidates share
// its channel) rather than every listener's; PostgreSQL (through 18 at
// least) still signals every listening backend of the database, which
// reads the notification and drops it. The named candidate's store wakes
// it at once, and its next Acquire, within a second, first runs a grant
// statement cut to the case it expects (a released lease not reserved for
// another candidate, granted on the acquire statement's terms), and the
// acquire statement only if that grants nothing (another candidate was
// first); a handover's notice (ReleaseTo) does the same for its successor.
// A store that hears the notification for another of its
// candidates wakes those 8 ms later (3 ms, and the 5 ms slack of every
// handover's notice), unless the later release notice or a grant's comes
// first. 5 ms after the release, the releasing store sends the plain
// release's notification on Options.Channel, if the lease is still free
// then, which wakes every other candidate (and every other listener of
// Options.Channel); if the named one took it, nobody else is woken. Close
// waits for that notification and sends it; a process that exits within
// those 5 ms without Close does not, and the other candidates then try
// at the expiry they last saw. Options.Channel longer than 60 bytes has
// no candidate channels (an identifier has 63 bytes at most): the
// notification naming the candidate goes to it, and every store's
// listener hears it. The lease is not reserved: any candidate may take
// it at once, and one whose own timer fires then does. So a graceful
// handover is taken by one follower alone rather than raced for by all
// of them, whose attempts took the server and the CPU from the winner's
// (its p99 fell from 7.6–8.2 ms to 3.4–4.9 ms, 10 followers on a
// 2-core machine; see BENCHMARKS.md for the candidate channels'
// share). The other followers are not woken at all when the
// named one takes the lease: they learn of the new term at their next
// attempt, at the expiry of the lease they last saw, as after a
// handover to a chosen successor. A named candidate that does not take
// the lease (it stopped without withdrawing) costs the handover 5 ms. A
// store of a version without candidate channels
// does not hear the notification naming a candidate, and learns of the
// release from the later one, 5 ms on; one of a version with transfers'
// handover notices takes a notification naming a candidate on
// Options.Channel for a handover's, and wakes its candidates the same way;
// an older one takes it for the release of another name, and its
// followers wait for the expiry they last saw, as for a handover.
//
// If that connection breaks it is opened again with backoff,
// and every watcher is then woken once, since it may have missed a
// notification meanwhile. Where LISTEN cannot work (a server that refuses it,
// or a transaction-pooling proxy in front of the server, where it is
// accepted but never delivers), the watchers stay silent and followers fall
// back to waking at the expiry that Acquire reported.
//
// # Planned statements
//
// Each connection of the store's own (see Options.MaxConns), and each
// session of the advisory strategy, sets plan_cache_mode to
// force_generic_plan for its session as it opens, and has the server
// prepare and plan the statements that a handover waits for (the acquire
// and the release) without running them. A connection runs those
// statements a few times in its life, too few for the server's own choice
// (a custom plan for each of the first five runs of a prepared
// statement) to come to the generic plan, which for the store's
// statements, lookups by key, is the same plan: planned at its run, an
// acquire took 1.1 ms on the server, and 0.3 ms planned ahead. Nothing is
// set where the statement does not run in the backend the connection
// started with (behind a pooling proxy the setting would stay with a
// server connection that others use), nor in another
// default_query_exec_mode than pgx's default, cache_statement, nor for
// the store's own connections when the pool given to the store has a
// BeforeAcquire, PrepareConn or AfterRelease hook (which may reset a
// session, DISCARD ALL say, and with it the statements prepared ahead).
// It is best effort, within 10 seconds: a connection on which it fails
// is used as it is.
//
// The same round trip then runs, once, the functions that a release runs
// (see warmUp): planning ahead reads the catalog for a plan, not for a
// run, and an advisory session most often releases once in its life, so
// its first release took 0.5 ms more than a later one. In one bench run,
// the advisory strategy's release statement ran in 0.94 ms on the server
// before, and 0.22 ms after.
//
// A VACUUM or ANALYZE of a table that these statements read updates the
// table's row of pg_class, which invalidates every session's plans of
// them: each plans its next one again, about a millisecond more if that
// is a handover's. Migrate sets the autovacuum thresholds of the advisory
// strategy's table (written by every grant and release) and of the
// candidates' table (by every refused attempt) to 10,000 changed rows
// rather than 50, and their fillfactor to 50 (migration 011): autovacuum
// visits a table of 300 rows 90 times less often, and its updates are
// heap-only, their dead versions pruned without VACUUM. With the defaults,
// autovacuum visited them about once a minute in the bench, and the
// handovers that followed made the tail of its advisory transfers.
//
// # Errors
//
// Every error names the operation and the election name, and wraps
// [leader.ErrLeaseLost] when the caller does not hold the lease,
// [leader.ErrReadOnly] when the server refuses writes (SQLSTATE 25006, a hot
// standby or default_transaction_read_only), [leader.ErrUnavailable] when
// the server cannot be reached or the connection broke, and the context's
// error when ctx ended. Passwords never appear in them.
//
// Errors that retrying will not mend wrap [leader.ErrPermanent] and say
// what to do: a refused password or login (SQLSTATE 28P01, 28000), an
// unknown database (3D000), missing tables (42P01, 3F000: run `leader
// migrate` or [Migrate]), a missing privilege (42501, with the GRANT to
// run, see Privileges), and a [*StrategyConflictError] for a name the other
// strategy holds. An Elector's Run
// returns the first such error that comes before any of its store calls
// succeeded, so that a misconfigured service fails at start; after one has
// succeeded, it logs them at ERROR, shows them in Status.Problem (and
// leaderhttp's /healthz), and retries with backoff, since a DBA may mend
// the grants while the service runs. A server that refuses every write as
// read-only for a whole TTL before any call has succeeded (a standby) ends
// Run the same way.
//
// A call cut short by its context closes its connection, but a statement
// that was waiting for a row lock may still run on the server once the lock
// is released: as for any write that fails with ErrUnavailable, its outcome
// is unknown. Set the pool's ConnConfig.BuildContextWatcherHandler to a
// pgconn.CancelRequestContextWatcherHandler to have such statements
// cancelled on the server as well.
package postgres

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
)

// LeaseStore is a leader.Store on a PostgreSQL lease table (see the package
// documentation). It is safe for concurrent use by many Electors and many
// names. Create it with NewLeaseStore after Migrate, and Close it when done.
type LeaseStore struct {
	pool *pgxpool.Pool
	// waits are the connections of prepared handovers (see
	// PrepareHandover): the preparer's, and successors' that wait for
	// one, and of the notices sent later (noticeLater), apart from pool
	// so that they never hold up renewals and releases.
	waits *pgxpool.Pool
	opts  Options
	sql   statements
	wakeups
	candidates
	renewals *renewBatcher
	beats    beats
	beatSQL  beatStatements
	// sweepDue is set when a new heartbeat was made, and the next
	// RenewBatch sweeps the heartbeats of gone processes (see sweep);
	// sweepRefused says once that the role may not delete them.
	sweepDue     atomic.Bool
	sweepRefused sync.Once
	// preps are the handovers prepared and not yet ended (see
	// PrepareHandover).
	preps preparations
	// later are the grant notices sent after a delay (see
	// noticeGrantLater).
	later laterNotices
	// waitedGrants counts the grants of Acquire statements that waited
	// for a prepared handover (acquireWaiting); tests read it.
	waitedGrants atomic.Int64
	// stagedClaims counts the waited grants that a staged release made,
	// which the successor's statement only read (claimStaged); tests
	// read it.
	stagedClaims atomic.Int64
	// stagedCommits counts the staged releases committed here (see
	// preparedHandover.Stage); tests read it.
	stagedCommits atomic.Int64
	// namedGrants counts the grants of Acquire calls that a release woke
	// by name, by the grant of a released lease (see wakeups.named);
	// tests read it.
	namedGrants atomic.Int64
	// namedTries counts the grant statements that Acquire calls woken by
	// name ran (see wakeups.named), granted or not; tests read it.
	namedTries atomic.Int64
	// pooled is set once PrepareHandover found the store behind a
	// transaction-pooling proxy: it refuses at once from then on.
	pooled atomic.Bool
	// noticeDelay is handoverNoticeDelay: how long after a grant its
	// NOTIFY is sent (noticeGrantLater), after a prepared handover's
	// unlock its release's (Commit), and after a plain release whose
	// notice went to a candidate channel the plain one (noticeFreedLater);
	// tests lengthen it.
	noticeDelay time.Duration
}

var (
	_ leader.Store        = (*LeaseStore)(nil)
	_ leader.FreeWatcher  = (*LeaseStore)(nil)
	_ leader.BatchRenewer = (*LeaseStore)(nil)
	_ leader.Transferer   = (*LeaseStore)(nil)
)

// NewLeaseStore returns a LeaseStore on the lease table that Migrate created
// with the same opts, or an *OptionsError if opts break a rule. It does not
// touch the database. It sends its statements on connections of its own,
// opened with pool's configuration (see Options.MaxConns), so that they
// never wait behind the caller's work for one of pool's connections. The
// pool stays the caller's: Close does not close it.
func NewLeaseStore(pool *pgxpool.Pool, opts Options) (*LeaseStore, error) {
	if pool == nil {
		return nil, errors.New("postgres: NewLeaseStore: pool is nil")
	}
	opts = opts.withDefaults()
	if err := opts.validate(); err != nil {
		return nil, err
	}
	d := newDialer(pool)
	sql := newStatements(opts)
	own, err := newOwnPool(pool, opts, d.hosts, sql.acquire, sql.release, sql.grantReleased)
	if err != nil {
		return nil, err
	}
	waits, err := newOwnPool(pool, opts, d.hosts)
	if err != nil {
		own.Close()
		return nil, err
	}
	s := &LeaseStore{
		pool:        own,
		waits:       waits,
		noticeDelay: handoverNoticeDelay,
		opts:        opts,
		sql:         sql,
		beatSQL:     newBeatStatements(opts),
		wakeups:     newWakeups(d, opts, "the lease store's wake-ups"),
	}
	s.candidateChannels, s.keepNamed = true, true
	s.candidates = newCandidates(own, opts, StrategyLease)
	s.renewals = newRenewBatcher(s)
	s.later.ctx, s.later.cancel = context.WithCancel(context.Background())
	return s, nil
}

// Options returns the store's options with their defaults filled in.
func (s *LeaseStore) Options() Options { return s.opts }

// ResetConnections closes the store's own connections (see
// Options.MaxConns); the next calls open new ones. Call it after a change
// that only new sessions see (an ALTER DATABASE ... SET, say); a
// connection broken by a failover or restart is replaced anyway, after one
// call fails on it.
func (s *LeaseStore) ResetConnections() {
	s.pool.Reset()
	s.waits.Reset()
}

// Close stops the store's wake-up listener, aborts the handovers it
// prepared that were neither committed nor aborted (see PrepareHandover),
// and closes its own connections; calls made after it fail. It does not
// close the pool given to NewLeaseStore.
func (s *LeaseStore) Close() {
	s.wakeups.Close()
	s.preps.close()
	s.later.close()
	s.pool.Close()
	s.waits.Close()
}

// leaseRow is a lease as the statements return it.
type leaseRow struct {
	term       int64
	held       bool
	holderID   string
	acquiredAt *time.Time
	expiresAt  *time.Time
	remaining  time.Duration
	transfer   transferRow
}

// dest returns the scan targets of a statement's columns from term to
// the transfer columns, as Observe returns them.
func (r *leaseRow) dest() []any {
	return append([]any{&r.term, &r.held, &r.holderID, &r.acquiredAt, &r.expiresAt, &r.remaining}, r.transfer.dest()...)
}

// lease reports r like leader.Lease: a lease without a holder has only its
// name, term, last reason and reservation.
func (r leaseRow) lease(name string) leader.Lease {
	l := leader.Lease{Name: name, Term: uint64(r.term)}
	if r.held && r.remaining > 0 && r.acquiredAt != nil && r.expiresAt != nil {
		l.HolderID = r.holderID
		l.AcquiredAt = *r.acquiredAt
		l.ExpiresAt = *r.expiresAt
		l.Remaining = r.remaining
	}
	r.transfer.apply(&l)
	return l
}

// interval returns ttl rounded up to the server's microsecond precision, so
// that the server never grants less than was asked.
func interval(ttl time.Duration) time.Duration {
	d := ttl.Truncate(time.Microsecond)
	if d < ttl && d <= math.MaxInt64-time.Microsecond {
		d += time.Microsecond
	}
	return d
}

// checkTTL refuses a ttl that would grant a lease already expired.
func checkTTL(op, name string, ttl time.Duration) error {
	if ttl <= 0 {
		return fmt.Errorf("postgres: %s %q: ttl must be positive, is %v", op, name, ttl)
	}
	return nil
}

// Acquire implements leader.Store. It grants the lease if it is free,
// expired, or held by c.Token, in one statement (see the package
// documentation; a candidate that a release named, or that waited for a
// prepared handover, first tries a statement that grants only a released
// lease, and then, if that granted nothing, the acquire statement), and
// sends a wake-up for a grant. When it grants nothing it
// reports the holder and Remaining as computed on the server's clock, and
// enlists the candidate in the same statement (see leader.Transferer). A
// lease released and reserved for another candidate (ReleaseTo) is not
// free: it is reported with Successor and Reserved (see Transfers in the
// package documentation).
func (s *LeaseStore) Acquire(ctx context.Context, name string, c leader.Candidate, ttl time.Duration) (leader.Lease, bool, error) {
	ctx, cancel := s.opts.bound(ctx)
	defer cancel()
	const op = "acquire"
	if err := checkTTL(op, name, ttl); err != nil {
		return leader.Lease{}, false, err
	}
	if err := checkPriority(op, name, c); err != nil {
		return leader.Lease{}, false, err
	}
	var (
		r             leaseRow
		granted, mine bool
		notified      int64
		err           error
	)
	dest := append([]any{&granted, &r.term, &r.held, &r.holderID, &r.acquiredAt, &r.expiresAt, &r.remaining, &notified, &mine},
		r.transfer.dest()...)
	// waited: the grant of a released lease granted the lease after
	// waiting for a prepared handover; tried: it ran, granted or not.
	waited, tried := false, false
	// stmt is the acquire statement to run below: acquireLocking for a
	// candidate to which a handover is prepared, so that an attempt
	// whose wait for it ended first waits for the row's lock, which a
	// staged release that grants it holds, and once that commits finds
	// the lease its own and is granted it again, under the term after
	// (acquire would refuse it from its snapshot, and nothing would tell
	// it of the staged grant). If the attempt's context ends first, the
	// preparation is left to c's next attempt.
	stmt := s.sql.acquire
	preparedAt, prepared := s.takePreparedAt(name, c.Token)
	if prepared {
		defer func() {
			if ctx.Err() != nil && !granted {
				s.putBackPrepared(name, c.Token, preparedAt)
			}
		}()
		stmt = s.sql.acquireLocking
		// A handover to c is prepared: wait for it, for a quarter of the
		// TTL at most, and never past half of what ctx leaves.
		wait := ttl / 4
		if d, ok := ctx.Deadline(); ok {
			wait = min(wait, time.Until(d)/2)
		}
		if wait >= time.Millisecond {
			waited, tried, err = s.acquireWaiting(ctx, name, c, ttl, wait, dest)
			if err != nil {
				return leader.Lease{}, false, wrapError(ctx, call(op, name), err)
			}
		}
	}
	named := false
	if s.takeNamed(name, c.Token) && !tried {
		// A release woke c by name (see wakeups.named): the lease is
		// most likely free for it. The grant statement cut to that case
		// first, and the acquire statement only if it grants nothing
		// (not again after acquireWaiting ran it: the mark is taken
		// all the same).
		s.namedTries.Add(1)
		err = s.pool.QueryRow(ctx, s.sql.grantReleased, name, c.Token, c.ID, interval(ttl), s.opts.Channel, int32(c.Priority)).
			Scan(dest...)
		switch {
		case err == nil:
			named = true
		case !errors.Is(err, pgx.ErrNoRows):
			return leader.Lease{}, false, wrapError(ctx, call(op, name), err)
		}
	}
	waited = waited && mine // else the statement below claims the name, and tries again
	for claimed := false; !waited && !named; claimed = true {
		err = s.pool.QueryRow(ctx, stmt, name, c.Token, c.ID, interval(ttl), s.opts.Channel, int32(c.Priority)).
			Scan(dest...)
		if err != nil || mine || claimed {
			break
		}
		// The name is not (yet) the lease strategy's: claim it, which
		// fails with a *StrategyConflictError while the advisory
		// strategy uses it, and try again.
		if err := claimStrategy(ctx, s.pool, s.opts, name, StrategyLease, ttl); err != nil {
			return leader.Lease{}, false, wrapError(ctx, call(op, name), err)
		}
	}
	if err == nil && !mine {
		// Claimed, and moved back before the second try: refused.
		return leader.Lease{}, false, wrapError(ctx, call(op, name), errStrategyMoved)
	}
	if errors.Is(err, pgx.ErrNoRows) {
		// Not granted, and the row that refused us was committed after
		// the statement began, so the statement's snapshot cannot show
		// it (this happens only to the losers of a race for a name's very
		// first grant). A new statement can.
		l, err := s.observe(ctx, op, name)
		return l, false, err
	}
	if err != nil {
		return leader.Lease{}, false, wrapError(ctx, call(op, name), err)
	}
	l := r.lease(name)
	if granted && waited {
		s.waitedGrants.Add(1)
	}
	if granted && named {
		s.namedGrants.Add(1)
	}
	if granted {
		s.noticeGrantLater(name, c.Token, r.term)
	}
	if granted {
		l.Remaining = min(l.Remaining, ttl)
		s.renewals.granted(name, c.Token, r.term, ttl)
		s.beats.forget(name, c.Token) // a grant is under no heartbeat
	}
	return l, granted, nil
}

// Renew implements leader.Store. It extends the lease by ttl from the
// server's now, only if it is unexpired and held by token under term;
// otherwise it returns an error wrapping leader.ErrLeaseLost. The lease is
// renewed on its own row, and taken out from under a heartbeat if it was
// under one. It reports the holder's priority, the reason of its grant and
// any pending request to hand over. Renew calls that reach the store together are sent as one
// statement (see renewBatcher). Electors renew with RenewBatch instead.
func (s *LeaseStore) Renew(ctx context.Context, name, token string, term uint64, ttl time.Duration) (leader.Lease, error) {
	ctx, cancel := s.opts.bound(ctx)
	defer cancel()
	if err := checkRenew(name, term, ttl); err != nil {
		return leader.Lease{}, err
	}
	return s.renewals.renew(&renewCall{
		ctx: ctx, name: name, token: token, term: int64(term),
		ttlMicros: int64(interval(ttl) / time.Microsecond), ttl: ttl,
		done: make(chan renewOutcome, 1),
	})
}

// Release implements leader.Store. In one statement it frees the lease if it
// is unexpired and held by token under term, keeping the term, and notifies
// the watchers; otherwise it returns an error wrapping leader.ErrLeaseLost.
func (s *LeaseStore) Release(ctx context.Context, name, token string, term uint64) error {
	if term > math.MaxInt64 {
		return fmt.Errorf("postgres: release %q term %d: %w", name, term, leader.ErrLeaseLost)
	}
	return s.release(ctx, name, token, term, nil, "", 0)
}

// ReleaseTo implements leader.Transferer. It is Release, with the
// reservation of the freed lease for successor's token until hold has
// passed on the server's clock recorded in the same statement, which also
// sends the wake-up: one round trip. The successor, woken, is granted it
// by its next Acquire; every other candidate's Acquire is refused and
// told the successor (see Acquire).
func (s *LeaseStore) ReleaseTo(ctx context.Context, name, token string, term uint64, successor leader.Candidate, reason leader.GrantReason, hold time.Duration) error {
	if err := checkHandover(name, term, successor, reason, hold); err != nil {
		return err
	}
	return s.release(ctx, name, token, term, &successor, reason, hold)
}

// release frees the lease of name held by token under term (see Release),
// reserved for successor for hold, with reason, if successor is not nil.
func (s *LeaseStore) release(ctx context.Context, name, token string, term uint64, successor *leader.Candidate, reason leader.GrantReason, hold time.Duration) error {
	ctx, cancel := s.opts.bound(ctx)
	defer cancel()
	const op = "release"
	lost := fmt.Errorf("postgres: %s %q term %d: %w", op, name, term, leader.ErrLeaseLost)
	args := []any{name, token, int64(term), s.opts.Channel, nil, nil, nil, nil}
	if successor != nil {
		args[4], args[5], args[6], args[7] = successor.Token, successor.ID, string(reason), interval(hold)
		lost = fmt.Errorf("postgres: %s %q term %d to %s: %w", op, name, term, successor.ID, leader.ErrLeaseLost)
	}
	s.renewals.ended(name, token, int64(term))
	s.beats.forget(name, token)
	var (
		released int64
		targeted bool
	)
	err := s.pool.QueryRow(ctx, s.sql.release, args...).Scan(&released, &targeted)
	if err != nil {
		return wrapError(ctx, call(op, name), err)
	}
	if released == 0 {
		return lost
	}
	if targeted {
		s.noticeFreedLater(name)
	}
	return nil
}

// RequestTransfer implements leader.Transferer. In one statement it records
// req on the lease's row, pending until ttl has passed on the server's
// clock (a ttl that is not positive clears it), if the lease is held; it
// returns the lease as Observe would. If the lease is not held it returns
// the lease as it stands and an error wrapping leader.ErrNoLeader. The
// holder reads the request at its next renewal.
func (s *LeaseStore) RequestTransfer(ctx context.Context, name string, req leader.TransferRequest, ttl time.Duration) (leader.Lease, error) {
	ctx, cancel := s.opts.bound(ctx)
	defer cancel()
	const op = "request transfer"
	to, why, pending := requestArgs(req, ttl)
	var r leaseRow
	err := s.pool.QueryRow(ctx, s.sql.request, name, to, why, pending).Scan(r.dest()...)
	if errors.Is(err, pgx.ErrNoRows) {
		l, err := s.observe(ctx, op, name)
		if err != nil {
			return l, err
		}
		return l, noLeader(name)
	}
	if err != nil {
		return leader.Lease{}, wrapError(ctx, call(op, name), err)
	}
	return r.lease(name), nil
}

// Observe implements leader.Store. It reports the lease without changing or
// locking it; Remaining is computed on the server's clock.
func (s *LeaseStore) Observe(ctx context.Context, name string) (leader.Lease, error) {
	ctx, cancel := s.opts.bound(ctx)
	defer cancel()
	return s.observe(ctx, "observe", name)
}

func (s *LeaseStore) observe(ctx context.Context, op, name string) (leader.Lease, error) {
	var r leaseRow
	err := s.pool.QueryRow(ctx, s.sql.observe, name).Scan(r.dest()...)
	if errors.Is(err, pgx.ErrNoRows) {
		return leader.Lease{Name: name}, nil
	}
	if err != nil {
		return leader.Lease{}, wrapError(ctx, call(op, name), err)
	}
	return r.lease(name), nil
}
