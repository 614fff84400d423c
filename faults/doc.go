// Package faults is the fault-injection suite: it holds only tests, which run
// Electors on the PostgreSQL stores under the faults that happen in real
// deployments and check that they keep the safety claims of DESIGN.md (issue
// 5): at most one believed leader per name at every instant (invariant 1),
// terms that never go back (invariant 2), bounded takeover (invariant 4), and
// a fenced resource that refuses every write a deposed leader makes once its
// successor has written.
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
// # Two modes
//
// CI mode, the default, runs every fault on every strategy (lease and
// advisory) a few times, the scenarios in parallel, within a few minutes on
// two cores, and logs a row per scenario: fault, strategy, trials, overlaps,
// term regressions and takeover p50/p99/max.
//
// Soak mode runs the scenarios over and over, for as long as the environment
// variable LEADER_SOAK (a Go duration) says, then prints a markdown table of
// the totals to standard output. Give go test a -timeout longer than the soak
// and -v (go test shows a passing package's output only with -v):
//
//	LEADER_SOAK=30m go test -race -count=1 -v -timeout 40m ./faults
package faults
