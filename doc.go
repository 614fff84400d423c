// Package leader elects one leader among many instances of a service, so that
// exactly one of them runs the cron jobs, consumes the queue or reconciles
// state; when it dies or steps down another takes over within a bound, and at
// no moment do two of them act as leader.
//
// An Elector campaigns for a name on a Store (PostgreSQL in package postgres,
// a file lock on one host in package filelock, memory in package leadertest),
// calls OnElected with a context that is cancelled the moment leadership is
// lost, calls OnDemoted once per loss, and campaigns again:
//
//	e, err := leader.New(store, leader.Config{
//		Name:      "nightly-report",
//		OnElected: func(ctx context.Context) { runReports(ctx) }, // ctx cancelled on loss
//		OnDemoted: func() { waitForReportsToStop() },             // once per loss
//	})
//	err = e.Run(ctx) // campaigns until ctx ends, then hands over
//
// # States
//
//	            granted                        renewal refused, read-only store,
//	  ┌──────────────────────────┐            no renewal before the stop point,
//	  │                          ▼            Resign, or Run's ctx ends
//	FOLLOW                      LEAD ─────────────────────────────────┐
//	  ▲  tries at once, then at  │ renews every RenewInterval         ▼
//	  │  the expiry the store    │                                 STEP DOWN
//	  │  reported, or when woken │                IsLeader false, leader ctx
//	  │  by a release            │                cancelled, OnDemoted, wait
//	  │                          │                for OnElected, release
//	  └──────────── sit out one RetryInterval ◄───────────────────────┘
//
// Run returns from FOLLOW, or after STEP DOWN, once its ctx has ended.
//
// # Why at most one instance leads
//
// Every grant and renewal is judged by the store on its own clock: the lease
// runs until the store's now + TTL. The leader notes, on its monotonic clock,
// the moment s at which it sent the request; the store's now is necessarily
// later than s, so the store's lease ends no earlier than s + TTL. The leader
// believes it leads only until its local deadline, s + TTL - DriftMargin,
// where DriftMargin covers the leader's clock running slower than the
// store's. So the interval in which an instance believes it leads lies inside
// the interval in which the store holds the lease for it, and the store never
// grants a held lease to another: no two instances believe they lead at once.
// Wall-clock jumps on a client change nothing, since only monotonic
// durations and the store's clock are used for decisions; the wall clock is
// read only for what is shown (such as Status.LastContact). The fault suite
// (directory faults) steps the client's wall clock an hour forward and back
// under a running leader to check it.
//
// If renewals fail, the leader gives up at StopGrace before its deadline: it
// cancels the leader context and calls OnDemoted, which has StopGrace to stop
// the work before anyone else can be granted the lease. Each renewal's
// context ends at that stop point, and the stop point is kept by a timer
// that does not wait for the store call, so a store that hangs cannot keep
// an instance leading past it.
//
// What this argument assumes, and so what is not guaranteed:
//
//   - The store's clock does not jump forward by more than DriftMargin. For
//     PostgreSQL that clock is the database server's wall clock
//     (clock_timestamp()): run its host with time synchronisation that slews
//     (chrony's and ntpd's default) rather than steps. A forward step larger
//     than DriftMargin ends leases early on the server while their holders
//     still believe they lead. Clients' clocks may do anything.
//   - Leader work stops when the leader context is cancelled, or within
//     StopGrace after it. Work that ignores the context can outlive the lease;
//     fence its writes with the term. The Elector logs when OnDemoted or
//     OnElected returns after the local deadline.
//   - A process that is paused (SIGSTOP, a debugger, a VM pause, a long
//     stall) stops its timers with it: it goes on believing it leads until
//     it resumes, possibly after the lease has passed to another, so for
//     that while two instances believe they lead. No elector can prevent
//     this, and checking the leader context does not help: a write decided
//     before the pause is sent after it, and a check made just after
//     resuming can pass before the overdue timer cancels the context. Only
//     fencing makes such writes safe: guard them with the term (see
//     Fencing) and have the resource refuse a term smaller than one it has
//     seen. The fault suite (directory faults) pauses real leader processes
//     past the TTL and asserts that a fenced resource refuses their resumed
//     writes. A supervisor in another process (the leader command has one)
//     can stop work outside the paused process at the deadline.
//   - A store call whose context ends may still take effect on the store
//     (a statement that commits after its client gave up). A campaign
//     attempt is therefore not cut short by Run's end, and a grant that
//     arrives late is released; but an attempt that times out just as Run
//     ends can leave a grant nobody holds, which runs out after TTL. For
//     PostgreSQL, a pgconn.CancelRequestContextWatcherHandler on the pool
//     cancels such statements on the server (the leader command sets one).
//   - A store whose lease is a lock held by a server session (the
//     PostgreSQL advisory strategy) loses it the moment the server ends
//     that session itself (pg_terminate_backend, a restart), not at the end
//     of a lease the leader can count on. Such a store reports the loss at
//     once (LossNotifier) and the leader steps down before a successor can
//     normally be granted the lock, but that order is not guaranteed on a
//     starved machine: fence writes with the term.
//
// # Fencing
//
// Every grant carries a term that grows by one with each grant of the name
// and never goes back. The leader context carries it (see TermFrom); guard
// writes downstream with it so that a deposed leader's late writes are
// refused.
//
// # Identity
//
// Config.ID is a human-readable name for logs and status. Stores compare a
// random token made by New for each Elector, so two instances started with
// the same ID are still two candidates and never share a lease.
//
// # Failover
//
// A leader that stops or resigns releases the lease; the store wakes the
// followers (PostgreSQL: NOTIFY) and one of them is granted it within one
// round trip. A leader that crashes is replaced when its lease runs out:
// followers sleep until the expiry the store reported, not on a blind poll.
// On a store that frees a dead holder's lease itself (the PostgreSQL
// advisory strategy) it is replaced as soon as the store notices.
package leader
