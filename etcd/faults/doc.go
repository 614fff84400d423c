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
// member's client port behind a proxy) and three Electors of one name
// (leader.New on an etcd.New Store, TTL 2 s and the default RenewInterval,
// DriftMargin and StopGrace: TTL/3, TTL/20, TTL/5). Each Elector has an
// etcd client of its own, which reaches the cluster through the members'
// proxies: either its own member's endpoint alone (candidate i talks to
// member i), or every member's. Each Elector records its beliefs with
// internal/history (its Store wrapped in a history.RecordingStore, and the
// recorder's OnElected and OnDemoted hooks). The recording store wraps
// the etcd Store as a plain leader.Store (and FreeWatcher, LossNotifier),
// so the Electors renew with Renew, one call per tenure, not with
// RenewBatch.
//
// While it leads, an Elector writes its term to a fenced register
// (internal/fenced) every 20 ms, in a throwaway PostgreSQL database
// (internal/pgtest) that no fault touches: it stands for a resource
// elsewhere. A trial waits for a leader that has had three writes
// accepted, lets it lead for 1.5 TTL (so that its renewals, not its grant
// alone, are what keeps its etcd lease alive when the fault comes: a
// store whose renewals did not keep the lease alive would be caught),
// then waits a random 0 to 700 ms so that the fault falls anywhere
// between two renewals, injects the fault, and waits for the outcome;
// after every takeover it writes once more with the deposed leader's
// term, which the register must refuse. A leadership lost before the
// fault is not a failure but is counted ("lost without a fault") and
// logged. If no leader with a greater term comes when one must, the
// scenario fails, injects no more faults, and still runs the checks
// below, which tell what happened instead.
//
// # How a scenario is judged
//
// At the end of a scenario every Elector is stopped, and:
//
//   - history.Check must find no overlap of two believed leaderships, no
//     term regression, no takeover slower than the scenario's bound, no
//     open interval it cannot end, nothing invalid;
//   - no term may have been granted to two instances;
//   - every faulted leadership that did not lead on must have been taken
//     over (a takeover counted from its term);
//   - the register's history must be linearizable (porcupine, through
//     fenced.CheckLinearizable), and no write may have been accepted with
//     a term smaller than that of a write accepted before it was sent;
//   - a leader's write refused while it still believes it leads fails the
//     test at once.
//
// Each scenario logs a row: scenario, trials, trials in which the leader
// led on, leaderships lost without a fault, overlaps, term regressions,
// terms granted twice, stale writes refused and accepted, takeovers and
// their p50, p99 and maximum.
//
// # Scenarios
//
// The takeover bound is 3 TTL (6 s) from the end of the old leader's
// belief to the new leader's OnElected, plus the outage where there is
// one. It is generous on purpose: the point is to catch a takeover that
// does not happen, not to benchmark.
//
//   - partition-cut, partition-blackhole (TestClientPartition): every
//     client has its own member's endpoint alone; the proxy of the
//     leader's member resets every connection and every new one (cut,
//     etcdtest's CutClient), or keeps them and forwards nothing, with no
//     FIN and no RST (BlackholeClient). The leader must stop believing by
//     its local deadline: no later than TTL - DriftMargin after the fault,
//     since its last successful call was sent before it (asserted per
//     trial); another must take over with a greater term within 3 TTL;
//     the leader cut off must not be elected again, nor still believe
//     once its successor is elected. Then the proxy heals and the old
//     leader comes back as a follower.
//   - member-kill-own-endpoint (TestMemberKilled): as above, but the
//     leader's member is killed with SIGKILL, which cuts the leader's
//     client off; afterwards the member is restarted and the test waits
//     for the cluster to be healthy. Same checks and bounds.
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
//     TTL - DriftMargin after the outage's start; after recovery a leader
//     with a greater term must be elected, and the takeover bound is 3
//     TTL plus the longest outage (start to healthy again). A member
//     stopped without a quorum left takes 8 to 16 s to exit (etcd's
//     graceful shutdown waits for its peers; etcdtest's member program
//     bounds it at 15 s), and serves nothing meanwhile: in the stop
//     variant the Elector leader may step down before the outage counted
//     here starts, and the window checked is shorter than the true loss
//     of quorum, but still sound.
//   - leader-kill (TestLeaderKilled): the leader's process dies. It is
//     modelled in this process rather than by killing a child process: at
//     the instant of the kill, the candidate is marked dead (its leader
//     work makes no more writes; one already sent is let finish), its
//     etcd client and then its Store are closed without any release
//     (Store.Close neither releases nor revokes: its etcd lease is kept
//     alive no more, as if the process had died), and its Elector is
//     stopped; every event it recorded after that instant is left out of
//     the history, so its last leadership is open, as a killed process
//     leaves it. That open interval is ended at the later of the kill and
//     the killed leader's local deadline (its last successful Acquire or
//     Renew's send time plus TTL less DriftMargin), which is stricter than
//     ending it at the kill: it also shows that etcd did not grant the
//     lease to another before a holder that might still have been alive
//     stopped believing. Another candidate must be elected with a greater
//     term within 3 TTL of that end, and within 3 TTL of the kill; a
//     replacement candidate with a new ID (and client, with every
//     endpoint) is started for the next trial.
//
// # The checks can fail
//
// Tried by hand on scratch copies of the repository, not committed:
//
//   - renewals that no longer keep the etcd lease alive (the keep-alive in
//     the Store's renewal round left out): partition-cut and leader-kill
//     fail with overlaps of 40 to 440 ms (etcd ends the lease while the
//     leader still believes), writes refused while their leader believes
//     it leads, and leaderships lost without a fault;
//   - an Elector whose local deadline is 2 TTL after its last call
//     instead of TTL - DriftMargin: both partition scenarios fail with
//     overlaps and the step-down check, and both quorum-loss scenarios
//     with leaderships inside the window where nobody may lead;
//   - an expired lease granted again with its own term instead of the
//     next: partition-cut and leader-kill fail with a term granted to two
//     instances, a term regression, and no leader with a greater term.
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
// default), each on a cluster of its own: 65 to 80 s with -race on two
// cores.
//
// Soak mode runs the scenarios in rounds of six trials over and over, for
// as long as the environment variable LEADER_SOAK_ETCD (a Go duration)
// says, then prints a markdown table of the totals per scenario to
// standard output. Each of the four tests loops until the soak ends,
// counted from when it starts: give go test a -parallel of at least 7 so
// that every scenario starts at once, a -timeout longer than the soak plus
// a round, and -v:
//
//	LEADER_SOAK_ETCD=30m go test -race -count=1 -v -parallel 7 -timeout 60m ./faults
//
// Set LEADER_TEST_LOG to see the Electors' and Stores' logs. The tests
// need PostgreSQL's server binaries (or LEADER_TEST_DATABASE_URL) for the
// register, as internal/pgtest says, and a Unix system for etcdtest.
package faults
