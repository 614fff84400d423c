// Package faults is the fault-injection suite of the etcd store (package
// etcd): it holds only tests, which run Electors on etcd.Store under the
// faults an etcd deployment meets and check the safety claims of DESIGN.md
// with the same machinery as the PostgreSQL faults (package faults at the
// repository's root): at most one believed leader per name at every
// instant (invariant 1), terms that are never handed out twice and never go
// back (invariant 2), bounded takeover (invariant 4), and a fenced
// resource that refuses every write a deposed leader makes once its
// successor has written.
//
// # Set-up of every scenario
//
// A scenario starts a 3-member etcd cluster of its own
// (etcdtest.StartCluster: three member processes on loopback, each
// member's client port behind a proxy of etcdtest's) and three
// candidates, each an Elector of one name per name it campaigns for
// (leader.New on an etcd.New Store, TTL 2 s and the default
// RenewInterval, DriftMargin and StopGrace: TTL/3, TTL/20, TTL/5), with an
// etcd client and a Store of its own. The candidates run in this process,
// except in the leader-kill and leader-pause scenarios, where each is a
// child process. A candidate's client knows one of three sets of
// endpoints:
//
//   - its own member's, behind etcdtest's proxy, alone (candidate i talks
//     to member i);
//   - every member's, behind etcdtest's proxies;
//   - its own link alone: a toxiproxy proxy (github.com/Shopify/toxiproxy,
//     in this process) of the candidate's own, from a loopback port to
//     member i's client port, which the faults of the leader's client act
//     on (links_test.go).
//
// Each Elector records its beliefs with internal/history: the hooks of a
// history.Recorder, and a recordingStore of this package around the etcd
// Store (recording_test.go). A history.RecordingStore is a plain
// leader.Store, so Electors on it renew each name with Renew; a
// recordingStore is a leader.BatchRenewer too, so that the Electors renew
// as they do on an etcd.Store in production: the Electors of a process
// that share a Store renew together, one RenewBatch call per round for
// every name the process leads (one keep-alive of the Store's shared etcd
// lease and one transaction, see package etcd). It records each renewal
// of a batch through a history.RecordingStore of its name, as sent before
// the batch was and answered after it was. Every scenario checks that its
// Electors renewed with RenewBatch alone.
//
// While it leads a name, a candidate writes its term to that name's
// fenced register (internal/fenced) every 20 ms, in a throwaway
// PostgreSQL database (internal/pgtest) that no fault touches: it stands
// for a resource elsewhere. A trial waits for a leader that has had three
// writes accepted, lets it lead for 1.5 TTL (so that its renewals, not its
// grant alone, are what keeps its etcd lease alive when the fault comes: a
// store whose renewals did not keep the lease alive would be caught), then
// waits a random 0 to 700 ms so that the fault falls anywhere between two
// renewals, injects the fault, and waits for the outcome; after every
// takeover it writes once more with the deposed leader's term, which the
// register must refuse. A leadership lost before the fault is not a
// failure but is counted ("lost without a fault") and logged. If no leader
// with a greater term comes when one must, the scenario fails, injects no
// more faults, and still runs the checks below, which tell what happened
// instead.
//
// # How a scenario is judged
//
// At the end of a scenario every Elector is stopped, and:
//
//   - history.Check must find no overlap of two believed leaderships of a
//     name, no term regression, no takeover slower than the scenario's
//     bound, no open interval it cannot end, nothing invalid;
//   - no term of a name may have been granted to two instances;
//   - every faulted leadership that did not lead on must have been taken
//     over (a takeover counted from its term);
//   - the registers' history must be linearizable (porcupine, through
//     fenced.CheckLinearizable), and no write may have been accepted with
//     a term smaller than that of a write to the same register accepted
//     before it was sent;
//   - the Electors must have renewed with RenewBatch calls and never with
//     Renew;
//   - a leader's write refused while it still believes it leads (its
//     leader context live) fails the test: at once in this process; in a
//     child process, unless the process was paused during that
//     leadership, as a line the child appends to a fail file of its own
//     in the directory it shares with the test;
//   - every child process's fail file, killed ones' too, is read once
//     every child has exited, and each line in it fails the test (a
//     killed child's own test output is lost).
//
// Each scenario logs a row: scenario, trials, trials in which the leader
// led on, leaderships lost without a fault, overlaps, term regressions,
// terms granted twice, stale writes refused and accepted, takeovers (one
// per faulted leadership: a faulted process may lead two names) and their
// p50, p99 and maximum.
//
// # Scenarios
//
// The takeover bound is 3 TTL (6 s) from the end of the old leader's
// belief to the new leader's OnElected, plus the outage where there is
// one. It is generous on purpose: the point is to catch a takeover that
// does not happen, not to benchmark.
//
//   - partition-cut, partition-blackhole (TestClientPartition): every
//     client has its own link alone; toxics on the leader's link, on both
//     streams, cut it: either every connection closed at once and every
//     new one reset (RST) as soon as toxiproxy accepts it (cut: a toxic of
//     this package closes each stream and drains it, and toxiproxy's
//     reset_peer toxic behind it, which receives nothing, makes toxiproxy
//     set SO_LINGER 0 on the connections it accepts from then on), or
//     every connection, open or new, kept but every byte dropped, with no
//     FIN and no RST (blackhole: toxiproxy's timeout toxic with a timeout
//     of 0). The leader must stop believing by its stop point (its local
//     deadline less StopGrace): no later than TTL - DriftMargin -
//     StopGrace after the fault, since its last successful call was sent
//     before it, plus 200 ms for its timer to fire and the end to be
//     recorded on a loaded machine (asserted per trial); another
//     must take over with a greater term within 3 TTL; the leader cut off
//     must not be elected again, nor still believe once its successor is
//     elected. Then the link heals: a new proxy without toxics replaces
//     it, on a port of its own, which the client's dialer dials from then
//     on, and the old one is stopped, which closes its connections; the
//     old leader comes back as a follower.
//   - client-delay (TestClientDelay): as above, but the toxic on the
//     leader's link delays every byte by 2.5 s each way, in order (a
//     toxic of this package: toxiproxy's latency toxic of v2.12 leaks its
//     goroutine when its connection closes with bytes delayed). No
//     renewal can then be answered before the leader's local deadline,
//     and its requests still reach etcd, late: the leader must stop
//     believing by its stop point, as above, another take over with a
//     greater term within 3 TTL, and the leader must not be elected again
//     (a grant answered that late is released, never acted on). Same
//     checks and healing as above.
//   - member-kill-own-endpoint (TestMemberKilled): every client has its
//     own member's endpoint alone; the leader's member is killed with
//     SIGKILL, which cuts the leader's client off; afterwards the member
//     is restarted and the test waits for the cluster to be healthy. Same
//     checks and bounds as the partitions.
//   - member-kill-all-endpoints (TestMemberKilled): every client has
//     every member's endpoint; a member is killed with SIGKILL: the
//     cluster's Raft leader in even trials, a follower in odd ones (etcd's
//     client balances over every endpoint, so the leader's client talks
//     to each). Once the cluster has a Raft leader again, the test waits
//     1.5 TTL: the Elector leader may have led on with its term (its
//     client moved to a live member in time; it must still lead with the
//     same term and have had writes accepted since: counted as "led on"),
//     or else another leader, or itself again, must be elected with a
//     greater term within 3 TTL of its belief's end. Then the member is
//     restarted.
//   - quorum-loss-stop, quorum-loss-pause (TestQuorumLoss): every client
//     has every endpoint; two of the three members are stopped (SIGTERM,
//     etcdtest's Stop) or paused (SIGSTOP) for 2 to 3 TTL: the Raft
//     leader and a follower in even trials, both followers in odd ones;
//     then restarted or resumed, and the test waits for the cluster to be
//     healthy. The outage starts when the second member is down (Stop has
//     returned, or SIGSTOP was sent). Whatever was committed before it
//     lets a leader believe until a TTL after it at most, so nobody may
//     believe it leads from the outage's start plus a TTL until the
//     members are brought back (checked on the history, and by polling
//     IsLeader as it happens); the leader must have stopped believing by
//     its stop point, TTL - DriftMargin - StopGrace after the outage's
//     start at the latest, plus 200 ms as above; after recovery a leader
//     with a greater term must be elected, and the takeover bound is 3
//     TTL plus the longest outage (start to healthy again). A member
//     stopped without a quorum left takes 8 to 16 s to exit (etcd's
//     graceful shutdown waits for its peers; etcdtest's member program
//     bounds it at 15 s), and serves nothing meanwhile: in the stop
//     variant the Elector leader may step down before the outage counted
//     here starts, and the window checked is shorter than the true loss
//     of quorum, but still sound.
//   - leader-kill, leader-pause (TestLeaderProcess): the candidates are
//     child processes (this test binary run again, for
//     TestCandidateChildProcess), each with every member's endpoint and
//     two names to campaign for, an Elector each on one Store: a process
//     that leads both renews them with one RenewBatch call per round.
//     Their histories and their registers' operations are written to a
//     directory the test shares with them, and read from there, and each
//     writes a line per RenewBatch call to a trace there, which must show
//     calls of both names at once. The scenario starts one child, waits
//     for it to lead both names, and then starts two more, so that the
//     first trial faults a process leading both. A trial's leader is the
//     process that leads the first name; the leaderships it faults are
//     those of every name whose register it wrote last, each of which
//     must be taken over with a greater term.
//     In leader-kill the leader's process is killed with SIGKILL; its
//     last leaderships are left open, as a killed process leaves them, and
//     are ended at the later of the kill and the killed leader's local
//     deadline (its last successful Acquire or renewal's send time plus
//     TTL less DriftMargin), which is stricter than ending them at the
//     kill: it also shows that etcd did not grant a name to another before
//     a holder that might still have been alive stopped believing.
//     Another process must be elected with a greater term within 3 TTL of
//     that end, and within 3 TTL of the kill; a replacement child is
//     started for the next trial.
//     In leader-pause the leader's process is stopped with SIGSTOP for 1.5
//     to 2.5 TTL, and resumed (SIGCONT) once every name it led has a
//     successor that has written. On resuming it makes, for each name it
//     led when it was paused, the write it had decided on when the pause
//     hit, with the term it led under: the one of the first name must be
//     refused (awaited), and none may be accepted. A paused process
//     believes as long as it is stopped, its timers not firing, but acts
//     on nothing; as recorded it overlaps its successors (logged, not
//     judged), and its recorded belief (up to the leader context seen
//     cancelled, or OnDemoted) must end no later than 500 ms after the
//     later of SIGCONT and its stop point (its last successful call's send
//     time plus TTL less DriftMargin less StopGrace): its overdue timers
//     fire within milliseconds of SIGCONT, and the 500 ms are for a loaded
//     machine under -race. It is judged to believe until its local
//     deadline (its last successful call's send time plus TTL less
//     DriftMargin, or its recorded end if sooner): the ends it recorded
//     after the pause are left out, and with that end there must be no
//     overlap, which shows that etcd granted no name to another before the
//     paused holder's deadline, nor took it back from the successor when
//     the paused Store ran again.
//
// Two quick tests check the machinery the scenarios rely on:
// TestLinkFaults, the link faults on an echo server (open and new
// connections closed and reset, black-holed, or delayed, and a link that
// forwards again once healed), and TestRecordingStoreRenewsInBatches, a
// recordingStore on an in-memory store under two Electors of two names
// (RenewBatch alone, calls of both names at once, every renewal recorded).
//
// # The checks can fail
//
// Tried by hand on scratch copies of the repository, not committed:
//
//   - renewals that no longer keep the etcd lease alive (the keep-alive in
//     the Store's renewal round left out): partition-cut,
//     partition-blackhole, client-delay, leader-kill and leader-pause fail
//     with overlaps of 20 to 470 ms (etcd ends the lease while the leader
//     still believes; in leader-pause, before the paused leader's
//     deadline), writes refused while their leader believes it leads, and
//     leaderships lost without a fault;
//   - the keep-alive left out of a renewal round only when the batch has
//     more than one name: leader-kill and leader-pause fail with overlaps
//     (their processes renew two names at once); the scenarios in this
//     process, whose batches have one name, pass;
//   - an Elector whose local deadline is 2 TTL after its last call
//     instead of TTL - DriftMargin: partition-cut, partition-blackhole and
//     client-delay fail with overlaps and the step-down check,
//     member-kill-own-endpoint with the step-down check, and both
//     quorum-loss scenarios with leaderships inside the window where
//     nobody may lead; leader-kill and leader-pause pass (a killed process
//     believes nothing; a paused one is judged at the deadline the test
//     computes, and on resuming it still stopped believing within 0 to
//     111 ms of SIGCONT in 12 trials: its Store's overdue expiry timer
//     reports the lease lost at once, and a pause of 1.5 TTL or more
//     mostly outlasts even that Elector's stop point);
//   - that Elector with its deadline 3 TTL after its last call, and deaf
//     to its Store's reports of loss (Lost not watched, ErrLeaseLost from
//     a renewal taken for a passing failure): leader-pause fails, 7 of 9
//     resumed leaderships believing 1.0 to 1.8 s after SIGCONT, 4.1 s past
//     their stop point (the check before this one, within a TTL of
//     SIGCONT, let every one of them pass);
//   - an expired lease granted again with its own term instead of the
//     next: partition-cut, partition-blackhole, client-delay, leader-kill
//     and leader-pause fail with a term granted to two instances, a term
//     regression, and no leader with a greater term;
//   - a Store whose expiry deletes the holder key whoever holds it (the
//     comparison with the holder key's revision left out of its
//     transaction): partition-cut, partition-blackhole, client-delay and
//     leader-pause fail with overlaps of 3 to 5 s (the deposed leader's
//     Store, back in touch with etcd, ends its successor's grant, and a
//     third is granted the name while the successor still renews);
//     leader-kill passes (a killed Store deletes nothing).
//
// A store that ended a grant at its own deadline too early (the Store's
// expiry timer set to TTL/4) did not fail partition-cut and
// partition-blackhole: the Store closes the grant's Lost channel before it
// sends the delete of the holder key, so the leader steps down a round
// trip or more before another can be granted; it only made every leader
// lose its lease half a second after its grant.
//
// # Two modes
//
// CI mode, the default, runs each scenario twice (two trials), the
// scenarios in parallel as go test's -parallel allows (GOMAXPROCS by
// default), each on a cluster of its own: 85 to 110 s with -race on two
// cores.
//
// Soak mode runs the scenarios in rounds of six trials over and over, for
// as long as the environment variable LEADER_SOAK_ETCD (a Go duration)
// says, then prints a markdown table of the totals per scenario to
// standard output. Each of the five tests loops until the soak ends,
// counted from when it starts: give go test a -parallel of at least 10 so
// that every scenario starts at once, a -timeout longer than the soak plus
// a round, and -v (from the repository's root, whose go.work includes
// this module):
//
//	LEADER_SOAK_ETCD=30m go test -race -count=1 -v -parallel 10 -timeout 60m ./etcd/faults
//
// Set LEADER_TEST_LOG to see the logs of the Electors and Stores of this
// process; the child processes log at level info to files of their own,
// whose last lines a failed scenario shows. The tests need
// PostgreSQL's server binaries (or LEADER_TEST_DATABASE_URL) for the
// register, as internal/pgtest says, and a Unix system for etcdtest and
// the child processes.
package faults
