// Package etcd is a [leader.Store] on etcd (v3 API): Electors in any
// number of processes and hosts elect a leader per name through an etcd
// cluster, with etcd's leases judging expiry and its transactions
// ordering every grant.
//
//	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{"etcd-0:2379"}})
//	...
//	store, err := etcd.New(cli) // keys under "leader/"; see WithPrefix
//	...
//	defer store.Close()
//	elector, err := leader.New(store, leader.Config{Name: "nightly-report"})
//
// A Store also implements [leader.FreeWatcher] (followers wake when a lease
// is freed, not when it is granted), [leader.BatchRenewer] (a round of
// renewals costs one keep-alive per lease TTL, however many names),
// [leader.LossNotifier] and [leader.Transferer] (handovers, priorities).
//
// # Key layout
//
// Every key is under the Store's prefix P (default "leader/"; see
// [WithPrefix]). A name N is path-escaped (url.PathEscape) into E, which
// never contains '/', so no name's keys are a prefix of another's:
//
//	P names/E/holder       the holder's token, on the holder's etcd lease:
//	                       present exactly while the lease is held
//	P names/E/record       the last grant, as JSON: term, holder ID,
//	                       priority, reason, ttl, grant time (display only),
//	                       whether it was released and for whom it was
//	                       reserved; on no lease, never deleted
//	P names/E/reserved     a successor's token, on a lease of the hold:
//	                       present while a handover reserves the lease
//	P held/<lease>/E       "<term> <token>", on the holder's lease (whose
//	                       ID is <lease>, in hex): the index a round of
//	                       renewals reads (see Renewals)
//	P requests/E           a pending request to hand over, as JSON
//	P candidates/E/<token> an enlisted candidate, as JSON
//
// Followers watch the prefix P names/E/. Deleting a name's record key
// while any process uses the name breaks invariant 2 (terms restart):
// leave the prefix to the Stores.
//
// # Grants and terms
//
// The term is the record's: each grant writes term+1 in the same
// transaction that writes the holder key, and the transaction commits only
// if the holder, record and reservation keys are as a read just before saw
// them (compares on their mod revisions). So a grant adds exactly one to
// the term, two candidates never both commit a grant from one state, and,
// since the record is on no lease, the term survives every release and
// every expiry, when etcd deletes the holder key (DESIGN.md invariant 2).
// Holders are told apart by token (the holder key's value), never by ID
// (invariant 3). An Acquire reads first, in a transaction that, if the
// lease is held by another token or reserved for one, enlists the
// candidate and refuses (one request); a grant then keeps the shared lease
// alive and commits (three requests in all).
//
// # Expiry, and whole seconds
//
// etcd's leases have TTLs of whole seconds, and a server minimum (the
// server's 1.5 election timeouts, rounded up: 2s with etcd's defaults of
// heartbeat 100ms and election 1s). A name held with ttl is on the Store's
// lease of ceil(ttl) seconds (or etcd's minimum, if longer), and every
// grant and renewal keeps that lease alive with a request sent during the
// call: etcd ends the lease no earlier than ceil(ttl) after a moment after
// the call began, so never before the holder's local deadline, which
// counts ttl from before the call (DESIGN.md invariant 1).
//
// One lease serves every name of the Store with one TTL, so it outlives
// any one holder that stops renewing while others go on. So the Store
// itself ends a grant at its deadline, ttl after its last grant or renewal
// was sent, on its monotonic clock, unless a renewal that keeps the key on
// its lease (a keep-alive round: see Renewals) is under way: it deletes the
// holder key, if no grant or renewal rewrote it since, which wakes the
// name's followers. A renewal that moves the key, under way meanwhile,
// then finds it gone and fails with leader.ErrLeaseLost; so does a
// renewal that began after the deadline. That deadline is no earlier than
// the holder's own, which counts from before the call. The Store deletes
// only what its own holders have stopped believing in; etcd's lease ends
// the rest. So:
//
//   - a holder that releases frees the name at once; one that stops
//     renewing (its Elector stepped down without releasing, or it holds a
//     lease for a window, as `leader once` does) frees it at its deadline;
//   - a grant, or a renewal that moved a key, whose write failed with an
//     unknown outcome (a timeout, a broken connection) may have committed
//     for nobody, or may still commit (etcd applies a proposal it took
//     even after the client gave up): the Store fences it off in the
//     background, until etcd answers, by rewriting the name's record as
//     the write read it, unless it changed since (the write compared its
//     revision, so it can no longer commit); if the record had changed
//     and the write did commit, the Store ends it at that call's deadline
//     likewise;
//   - a holder whose process dies, or which cannot reach etcd, frees it
//     when etcd ends the lease: from ceil(ttl) (or etcd's minimum) to
//     about half a second more (etcd looks for expired leases twice a
//     second) after the last keep-alive. That is the Store's granularity:
//     whole seconds.
//
// etcd offers no clock to read, so a follower cannot learn when a held
// lease will end. It is told the holder's ttl as Remaining: never less
// than the holder's own deadline leaves, never more than the holder's
// ttl. Followers learn of the end from their watch (see Watches), not from
// Remaining; a holder is told ttl less the time its call took.
//
// # Renewals
//
// RenewBatch renews the names this Store holds, each with the ttl of its
// grant, in one round trip however many they are: one keep-alive of each
// shared lease (one per distinct lease TTL), sent together with one
// transaction that reads the held index of those leases (one range read
// each) and the pending requests to hand over. A name whose index entry
// still shows its term and token is renewed; one whose entry is gone (its
// key was deleted, or etcd ended its lease) is lost, and the others are
// still renewed. A renewal with another ttl, or of a grant whose key is
// not on this Store's own lease for its ttl (a grant made through another
// Store, say), reads the name's state and moves its key onto this Store's
// lease for the new ttl, in a transaction of its own: only a keep-alive of
// that lease keeps the key for the ttl the holder is told. If a
// keep-alive finds a shared lease gone (revoked, or expired while etcd
// could not be reached), every name on it is lost: the
// channels of [Store.Lost] close, and the next renewals of those names
// fail with leader.ErrLeaseLost.
//
// # Watches
//
// Watch and WatchFree share one etcd watch per name and Store, on the
// name's keys; the first call starts it just after a read of its own, so
// nothing that happens after any call returns is missed. A revision that writes the
// holder key is a grant: it wakes Watch's channels only. One that deletes
// the holder key (a release, the Store's expiry of an unrenewed grant, or
// etcd ending the lease) or the reservation wakes both. If etcd ends the
// watch (a compaction, a member without a leader), the Store wakes every
// watcher and watches again.
//
// # Transfers
//
// Candidates enlist as keys on leases of the Store's for soft state,
// granted for twice the entry's ttl (rounded up to whole seconds) and used
// for new entries during their first half, so that etcd ends an entry
// between its ttl and about twice that. A request to hand over is a key on
// such a lease; it lapses on the readers' wall clocks at the requester's
// clock plus its ttl (it is a hint: no decision about the lease depends
// on it), and etcd removes it with its lease, within about twice its ttl,
// whatever the clocks say. Every grant and release deletes it. ReleaseTo is a release that
// also writes the reservation key, on a fresh lease of ceil(hold) seconds:
// until etcd ends it, Acquire grants the lease to the successor's token
// alone, with the reason of the handover; followers are told the
// successor's ID and what remains of the hold as Reserved (on the
// releaser's wall clock: a hint). Each grant records the
// candidate's priority and why it was granted: a release, an expiry (the
// record was not released), a handover, or "" for a first grant or one to
// the holder itself.
//
// # Errors and contexts
//
// Every method honours its context; one without a deadline is bounded by
// the call timeout ([WithCallTimeout]). Errors wrap the caller's context
// error when it ended, leader.ErrUnavailable when etcd could not be
// reached, had no leader, or did not answer in time (the outcome of a
// write is then unknown), leader.ErrPermanent when etcd refused for want
// of authentication or permission, and leader.ErrLeaseLost as the
// contract says. After Close, every method fails with ErrClosed (with
// leader.ErrLeaseLost from renewals and releases, as from one that Close
// cut short). Waiting for another call's grant of a lease ends with the
// waiter's own context.
//
// # Guarantees, and what is assumed
//
// At most one holder per name (DESIGN.md invariant 1), as long as etcd's
// clock does not run faster than the holder's by more than the Elector's
// DriftMargin, and etcd is linearizable (its default; the Store's reads
// are linearizable reads). Terms grow by one per grant and never go back
// (invariant 2) unless someone deletes the record keys. A paused leader
// believes it leads until it resumes, as on every store: fence its writes
// with the term.
package etcd
