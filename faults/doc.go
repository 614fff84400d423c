// Package faults is the fault-injection suite: it holds only tests, which run
// Electors on the PostgreSQL stores under the faults that happen in real
// deployments and check that they keep the safety claims of DESIGN.md (issue
// 5): at most one believed leader per name at every instant (invariant 1;
// a paused process is the exception no Elector can prevent, see Process
// faults), terms that never go back (invariant 2), bounded takeover
// (invariant 4), and a fenced resource that refuses every write a deposed
// leader makes once its successor has written. The process and promotion
// faults also check the library's own fence, postgres.Fence (see Fenced
// transactions).
//
// # Network faults
//
// Each scenario runs three Electors of one name in this process, each with a
// pool of its own that reaches the test database through a TCP proxy of its
// own (github.com/Shopify/toxiproxy/v2, run in process on 127.0.0.1, no
// separate binary), each recording its believed leaderships with
// internal/history. While it leads, an Elector writes its term to a fenced
// register (internal/fenced) every 20 ms, through a pool that bypasses the
// proxies, so that the register records what every leader did. A trial waits
// for a leader, waits a random 0 to 700 ms, breaks the current leader's proxy,
// waits for another Elector to lead with a greater term, checks that a write
// with the old term is refused, and heals the proxy so that the old leader
// comes back as a follower. The faults are:
//
//   - black-hole: bytes silently dropped both ways, with no FIN and no RST
//     (toxiproxy's timeout toxic with timeout 0, on both streams);
//   - reset: each connection reset (RST both ways) at the next byte either
//     side sends (the reset_peer toxic, on both streams);
//   - delay: 2.5 s of latency both ways, longer than the renew deadline
//     (a latency toxic of our own, see delay_toxic_test.go).
//
// At the end of a scenario, history.Check must find no overlap, no term
// regression and no takeover slower than the fault's bound, the register's
// history must be linearizable (porcupine), and every write with a term
// smaller than that of a write accepted before it was sent must have been
// refused.
//
// # Process faults
//
// Each scenario runs three candidates as real processes: the test binary,
// re-executed to run TestCandidateChildProcess, each with an Elector of the
// same name on the scenario's store (TTL 2 s), recording its beliefs with
// internal/history and, while it leads, writing its term to the fenced
// register every 20 ms, into files in a directory it shares with the test
// (history.Load and fenced.LoadOps read them all, O_APPEND lines surviving
// a SIGKILL). A child stops when its standard input closes, so that none
// outlives the test binary. The test finds the leader from the register:
// the writer of the greatest term, once it has written three times. The
// faults are:
//
//   - SIGKILL: a trial waits a random 0 to 700 ms, kills the leader, waits
//     for another candidate to lead and write with a greater term, checks
//     that a write with the killed leader's term is refused, and starts a
//     replacement process. A killed process leaves its last leadership
//     open; it ends at the CLOCK_MONOTONIC reading taken as soon as
//     kill(2) returned, as a dead process believes nothing.
//     history.Check must find no overlap, no term regression and every
//     takeover from a killed leader within 3 TTL.
//   - SIGSTOP past the TTL: a trial stops the leader for a random 1.5 to
//     2.5 TTL, waits for a successor with a greater term that has written,
//     then sends SIGCONT. A paused process's timers do not fire, so it
//     believes it leads until it resumes and notices: a paused process
//     that resumes overlaps its successor, and this cannot be prevented
//     without fencing. The child models the leader work that had checked
//     its leader context and was about to write when the pause hit: on
//     resuming, if it led when it was paused, it makes that write, with
//     the term it led under. The test asserts that the fenced register
//     refuses it (the write is found in the register's history, refused,
//     in every trial), that the resumed process stops believing within
//     a TTL of SIGCONT, that the successor was elected within 3 TTL of the
//     pause, and that terms never go back. The overlaps are counted in the
//     table, and each one must be between a paused leader and its
//     successor; any other overlap fails the test.
//
// In both, the register's history must be linearizable and no stale write
// may be accepted: the fence, not the Elector, is what keeps a paused
// leader's writes out. Each of the child's writes to the register, the
// resumed one included, is followed by a fenced transaction with the same
// term (see Fenced transactions), in the scenario's database, which holds
// the lease table too; the transactions the paused leader makes with its
// term after SIGCONT (the resumed one, and any its leader work makes
// before its overdue timer cancels it) are that trial's stale ones.
//
// # Fenced transactions
//
// In the process faults and the promotion fault, the leader work also
// writes to a table of the test's own, fenced_work, in the election's
// database: a transaction (pgx.BeginFunc) that calls postgres.Fence with the
// election name and the term the work was granted, then inserts the
// writer, that term, a unique value, and the term the stores' status view
// shows for the election (read after Fence has locked the lease row: the
// term that holds the lease when the transaction commits), and commits.
// Each transaction is recorded (fencetx_test.go) as committed, refused
// (leader.ErrLeaseLost: Fence refused the term) or failed (anything else,
// such as a server that cannot be reached; counted apart), with its
// CLOCK_MONOTONIC start and end. The sessions of these transactions set
// idle_in_transaction_session_timeout to a TTL: a process paused inside a
// fenced transaction holds the lease row's lock, for which every grant
// waits, so the server must end its session for a successor to be granted,
// as it should in a deployment. The checks:
//
//   - per trial, the stale transactions: those the deposed leader made
//     with its term once its lease was lost (after SIGCONT, or after the
//     promotion). There must be at least one, the one the trial is built
//     to make (the paused leader's write in flight on resuming, or the old
//     leader's write on the promoted server), at least one refused (so
//     that the check cannot pass vacuously) and none committed; and the
//     successor must have committed some with its term, so that the fence
//     does not just refuse everything. Each trial logs one line,
//     "fence-stale fault=%q strategy=%s trial=%d writer=%s term=%d
//     attempted=%d refused=%d accepted=%d failed=%d", for a soak to
//     tabulate;
//   - over the scenario (and in the SIGKILL scenario too), no transaction
//     that began after a leader with a greater term was elected (its
//     OnElected, in the history of beliefs) committed;
//   - the table afterwards: every row's term is the lease's term read in
//     its transaction, a term the history shows its writer was granted,
//     and no smaller than that of any row inserted before it (terms never
//     go back); no refused transaction's row is there.
//
// Taking Fence out of the transaction (tried by hand, not committed) fails
// all three: the stale transactions commit, with a lease term that is the
// successor's.
//
// # Database faults
//
// Each scenario runs three Electors in this process, as the network faults
// do, on a private cluster of its own (pgtest.NewCluster), so that a fault
// can hit the whole server. Each Elector has a pool of its own of four
// connections, and every connection it makes, from the pool or opened by its
// store from the pool's configuration, carries an application_name of its
// own. The fenced register is on the shared cluster, which no fault
// touches: it stands for a resource elsewhere, which a crash of the
// election's server must not roll back nor a read-only one refuse. A trial
// waits a random 0 to 700 ms after a leader has written three times, injects
// the fault and waits until the fault is over. Then either another leader
// with a greater term writes (a takeover: the old leader must no longer
// believe, and a write with its term must be refused), or, where the
// strategy allows it, the old leader still leads with its term a TTL after
// the fault ended without having reported a loss: it renewed after the
// fault and led on. The faults are:
//
//   - terminate: pg_terminate_backend of every session of the leader.
//     Lease: the pool opens new connections and the leader renews, keeping
//     its lease, which is allowed. Advisory: the lock ends with the session,
//     the store tells the Elector (leader.LossNotifier) and another
//     candidate takes over at once.
//   - restart-fast: pg_ctl stop -m fast, then start: at once in even
//     trials (an outage of a fraction of a second), 1.25 TTL after the stop
//     in odd ones. Lease: after a short outage the leader renews once the
//     server is back and leads on, which is allowed; after a long one it
//     steps down at its local deadline while the server is down, and a
//     candidate is granted the lease once the server is back. Advisory:
//     the sessions, and the lock, end with the server; the leader steps
//     down at once and a candidate is granted the lock once the server is
//     back.
//   - restart-immediate: pg_ctl stop -m immediate, a crash: no checkpoint,
//     crash recovery at the start. As restart-fast, and more: with
//     synchronous_commit off (as on the test cluster, and on some
//     production servers) the commits whose WAL was still in the server's
//     memory are lost. The stores therefore commit grants and renewals
//     synchronously whatever synchronous_commit says (durableCommit in
//     package postgres); without that, this scenario saw a grant lost and
//     its term granted again to another candidate.
//   - postmaster-kill: SIGKILL to the postmaster, as the out-of-memory
//     killer would; its backends end when they notice, then the server
//     starts with crash recovery. As restart-immediate.
//   - read-only: the server turned read-only, then a failover to a
//     read-only replica, on the same server: default_transaction_read_only
//     is turned on for the server (ALTER SYSTEM and a reload), so that
//     every write, on a live session or a new one, is refused with SQLSTATE
//     25006 as a hot standby refuses it; then every session of the
//     database is ended, as a failover ends them, and with them every
//     advisory lock. 1.5 TTL after the switch the setting is turned off
//     again, as a promotion makes a standby writable without ending its
//     sessions. Lease: the leader's first renewal after the switch is
//     refused (leader.ErrReadOnly) and it steps down at once, without
//     waiting for its deadline (loss reason "error", asserted); nobody is
//     granted the lease until the promotion. Advisory: the leader steps
//     down at once too, at its first heartbeat after the switch (the
//     heartbeat statement holds an UPDATE, refused even when it would
//     change nothing: leader.ErrReadOnly) or when its session is ended,
//     whichever comes first; grants are refused until the promotion.
//   - pool-exhausted: the application's own work takes every connection
//     of the leader's pool and holds each in a query for 1.5 TTL. The
//     stores send their statements on connections of their own
//     (postgres.Options.MaxConns), so the leader must lead on, on both
//     strategies (asserted).
//
// At the end of a scenario, history.Check must find no overlap, no term
// regression, and no takeover slower than 3 TTL plus the scenario's longest
// outage (the time the server refused every grant: the restart, or the
// read-only period), and the register's history must be linearizable with
// no stale write accepted, as for the network faults. Only the takeovers
// that happened are counted in the table; its trials count every fault
// injected.
//
// # Promotion
//
// TestPromotionFault fails the election's database over to a streaming
// standby that missed the last handover, on both strategies. A trial needs
// a cluster of its own (pgtest.NewReplicatedCluster: a primary and an
// asynchronous standby, the old primary gone after the promotion), so each
// trial starts one, with three Electors that reach the primary through a
// proxy (PrimaryProxied), a fresh history directory and a fresh fenced
// register, on the shared cluster as for the database faults. Once a leader
// has written three times and the standby has replayed its grant,
// replication is cut for a TTL, so that the standby's copy of that lease
// runs out; the leader resigns and another is elected on the primary
// alone, a term the standby never hears of. A random 0 to 700 ms after that
// leader has written three times, the primary's host vanishes (no FIN, no
// RST) and the standby is promoted; a fourth Elector, which first connects
// then, to the promoted server, must take over with a greater term (the
// promoted server grants nothing until a TTL after it first answered on
// its new timeline, and its terms are above (timeline-1)<<40: see the
// Failover section of package postgres), and write, within 2 TTL of the
// end of the promotion (the TTL, a follower's next attempt, slack); a
// write with the old leader's term must then be refused. history.Check
// must find no overlap (the old leader believes until its local deadline,
// on a server the new one cannot see), no term regression, and no takeover
// slower than the outage (from the vanishing to the end of the promotion)
// plus 2 TTL; the register's history must be linearizable with no stale
// write accepted. The leaders' fenced transactions go to the primary of
// the moment, as from a client whose connection string follows the
// primary: to the primary until the promotion (straight to its port, so
// that once it is gone they fail at once instead of hanging on the black
// hole), then to the promoted server. So the old leader's work, which
// believes it leads until its local deadline, goes on making them with
// its term after the promotion, on the promoted server; and after the
// takeover the test makes one more on its behalf there. Those are the
// trial's stale transactions, which Fence must refuse; the table is
// checked on the promoted server (see Fenced transactions).
//
// # Wall clock
//
// The library reads the wall clock only through internal/wallclock, for
// what it shows (Status.LastContact, the advisory store's ExpiresAt),
// never for what it decides. Each scenario runs three Electors in this
// process, with a TTL of 6 s (the scenario fails on any change of leader
// while the clock is stepped, which a late renewal at 2 s could cause on a
// busy machine); while one leads, the test steps that clock an hour
// forward, two hours back and an hour forward again, holding each step
// for 1.5 TTL. The leader must keep leading under the same term through
// every step, nobody else may lead, and its Status.LastContact must move
// with the step (which shows the step reached it); then it resigns and
// another takes over. The scenarios do not run in parallel with each
// other, since the clock is the process's.
//
// # Two modes
//
// CI mode, the default, runs every fault on every strategy (lease and
// advisory) a few times, the scenarios in parallel, within a few minutes on
// two cores, and logs a row per scenario: fault, strategy, trials, overlaps,
// term regressions, stale writes refused and accepted, stale fenced
// transactions attempted, refused, accepted and failed (a dash in the
// scenarios that make none), and takeover p50/p99/max.
//
// Soak mode runs the scenarios over and over, for as long as the environment
// variable LEADER_SOAK (a Go duration) says, then prints a markdown table of
// the totals to standard output. Each of the five tests loops until the
// soak ends, counted from when it starts: give go test a -parallel of at
// least 5 so that they all start at once, a -timeout longer than the soak
// plus a round, and -v (go test shows a passing package's output only with
// -v):
//
//	LEADER_SOAK=30m go test -race -count=1 -v -parallel 6 -timeout 60m ./faults
//
// # The stall probe
//
// The advisory strategy's safety after the server ends a holder's session
// rests on the holder's process noticing the server's FATAL message within
// TakeoverGrace (see postgres.AdvisoryStore): a process starved of CPU for
// longer is in the position of a paused one. So the test process measures,
// all along, how late it runs a goroutine woken by bytes on a loopback
// socket (the path of that notice): every 5 ms one goroutine sends its
// CLOCK_MONOTONIC reading to another. A failed history check reports the
// late wake-ups around each overlap, and the soak prints how many came
// later than TakeoverGrace. The probe excuses nothing: an overlap fails
// its test whatever the probe saw.
package faults
