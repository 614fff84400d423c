package leadertest

import (
	"slices"
	"testing"
	"time"

	"github.com/leaderelect/leader"
)

// TestStore runs the conformance suite for leader.Store against the stores
// newStore returns. Every Store implementation must pass it; a store's own
// tests call it from a test function:
//
//	func TestConformance(t *testing.T) {
//		leadertest.TestStore(t, func(t *testing.T) leader.Store {
//			s := openMyStore(t)
//			t.Cleanup(func() { s.Close() })
//			return s
//		})
//	}
//
// newStore is called once per subtest, from that subtest's goroutine, and
// must return a store that is empty or at least shares no election names
// with other stores (the suite uses random names, so one database may back
// every store). It arranges its own cleanup with t.Cleanup. Subtests run in
// parallel, each with a fresh store, and read as sentences: a failure names
// the clause of the contract (the doc comments of leader.Store and
// leader.Lease) that the store broke.
//
// The suite judges time on the test's monotonic clock and assumes only that
// the store's clock runs at the same rate; it never asserts tight timings.
// Expiry tests use TTLs of a few hundred milliseconds and the whole suite
// takes a few seconds.
//
// The Watch subtests need wake-ups to be delivered for events after Watch
// returns. The contract lets a store that cannot deliver them at the moment
// (for example behind a transaction-pooling proxy) keep its channels silent;
// run the suite with the store in its normal mode.
//
// A store that implements leader.FreeWatcher (the suite asks the first
// store newStore returns) must also pass the WatchFree subtests, and one
// that implements leader.BatchRenewer the RenewBatch subtests, which also
// run the Renew subtests again with each renewal made by RenewBatch, and
// one that implements leader.Transferer the transfer subtests: handovers
// to a named successor and to a gone one, concurrent requests, and a
// handover that races the lease's expiry; and if it implements
// leader.HandoverWatcher too, the subtests of whom a handover wakes, and
// if it also implements leader.HandoverPreparer, the subtests of prepared
// handovers (the successor's first Acquire after the preparation's
// wake-up is granted by the commit; an abort grants nothing; a
// preparation ends once).
func TestStore(t *testing.T, newStore func(t *testing.T) leader.Store) {
	t.Helper()
	cases := conformanceCases
	first := newStore(t)
	if _, ok := first.(leader.FreeWatcher); ok {
		cases = append(slices.Clip(cases), freeWatcherCases...)
	}
	if _, ok := first.(leader.BatchRenewer); ok {
		cases = append(slices.Clip(cases), batchRenewerCases()...)
	}
	if _, ok := first.(leader.Transferer); ok {
		cases = append(slices.Clip(cases), transfererCases...)
		if _, ok := first.(leader.HandoverWatcher); ok {
			cases = append(slices.Clip(cases), handoverWatcherCases...)
			if _, ok := first.(leader.HandoverPreparer); ok {
				cases = append(slices.Clip(cases), preparerCases...)
			}
		}
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			c.run(t, newStore(t))
		})
	}
}

// Timing of the suite. Expiry tests use shortTTL; tests that must not see an
// expiry use longTTL. Nothing is asserted to happen faster than waitTimeout.
const (
	// quietPeriod is how long watch channels must stay empty for the
	// wake-ups of an event to be taken as all delivered: long, as a busy
	// machine may deliver a late one after a shorter quiet, which the
	// next check would take for a wake-up of the next event.
	quietPeriod = 2 * time.Second
	shortTTL    = 400 * time.Millisecond
	// entryTTL is for an entry that must still be there at the next look,
	// and run out a little later: a busy machine may take shortTTL
	// between two calls.
	entryTTL    = 2 * time.Second
	longTTL     = time.Minute
	waitTimeout = 5 * time.Second
	pollEvery   = 10 * time.Millisecond
	// clockSlack absorbs the rounding of a store that keeps times at
	// microsecond precision, and the tiny difference in rate between the
	// store's clock and ours, when comparing deadlines.
	clockSlack = 2 * time.Millisecond
)

type conformanceCase struct {
	name string
	run  func(t *testing.T, s leader.Store)
}

// conformanceCases is the suite, grouped by the clause of the contract each
// case checks.
var conformanceCases = []conformanceCase{
	// Acquire and Observe.
	{"a name never granted is observed as a zero lease with its name", testObserveNeverGranted},
	{"a first acquire of a name is granted with a term of at least one", testFirstAcquire},
	{"a second candidate cannot acquire a held lease", testAcquireHeld},
	{"the holder acquiring again is a new grant with the next term", testReacquireByHolder},
	{"a candidate with the holder's ID but another token is another candidate", testSameIDOtherToken},
	{"names are independent", testNamesIndependent},

	// Renew.
	{"a renewal by the holder extends the lease and keeps the term", testRenewExtends},
	{"a renewal with another token is refused and changes nothing", testRenewWrongToken},
	{"a renewal with a stale term is refused and changes nothing", testRenewStaleTerm},
	{"a renewal of a name never granted is refused and creates nothing", testRenewNeverGranted},
	{"a renewal after the lease expired is refused and does not revive it", testRenewAfterExpiry},

	// Expiry.
	{"an expired lease is free and the next grant has the next term", testExpiry},

	// Release.
	{"a release frees the lease and the next grant has the next term", testRelease},
	{"a release with another token is refused and changes nothing", testReleaseWrongToken},
	{"a release with a stale term is refused and changes nothing", testReleaseStaleTerm},
	{"a second release of the same grant is refused", testReleaseTwice},
	{"a release of a name never granted is refused and creates nothing", testReleaseNeverGranted},
	{"a release after the lease expired is refused", testReleaseAfterExpiry},

	// Terms.
	{"terms grow by one at every grant over many handovers", testTermsGrow},

	// Watch.
	{"a watcher wakes when the holder releases", testWatchRelease},
	{"a watcher wakes when the lease is granted", testWatchGrant},
	{"every watcher of a name wakes", testWatchTwoWatchers},
	{"watchers of different names each wake for their own name", testWatchTwoNames},
	{"a watcher that does not read never blocks the store", testWatchSlowReader},
	{"a watch channel is closed after its context ends", testWatchClosed},

	// Concurrency.
	{"exactly one of many racing candidates is granted a free lease", testAcquireRace},
	{"a history of racing grants, renewals and releases is consistent", testRaceHistory},

	// Context.
	{"every method returns promptly with an error when its context is cancelled", testCancelledContext},
	{"every method returns promptly with an error when its deadline has passed", testExpiredContext},

	// Leader safety.
	{"the remaining time reported to a follower never exceeds the holder's ttl", testRemainingBounded},
	{"a follower is never granted the lease before the holder's deadline", testNoEarlyGrant},
}
