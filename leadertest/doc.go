// Package leadertest helps test code that uses package leader, and tests
// the stores it runs on.
//
// It has two audiences.
//
// Users of an [leader.Elector] test their leader work with [MemStore], an
// in-memory [leader.Store]: several Electors created with [leader.New] on
// one MemStore campaign against each other in one process, with no database
// and no files. A MemStore judges expiry on the process's monotonic clock,
// so expiry takes real time: use short TTLs (leader.MinTTL is one second),
// and wait for what you expect by polling [leader.Elector.IsLeader] or
// [leader.Elector.Status], or with a signal from OnElected, never by
// sleeping a fixed time.
//
// Authors of a store (the PostgreSQL and file-lock stores of this module, or
// your own) run [TestStore], the conformance suite, from their tests. It
// checks every clause of the Store contract, as written in the doc comments
// of [leader.Store] and [leader.Lease]: grants, terms that grow by one per
// grant and never go back, holders told apart by token rather than ID,
// refused renewals and releases that change nothing, expiry on the store's
// clock, wake-ups for watchers, contexts honoured, and a history of racing
// candidates checked for two holders of one term and for grants before the
// previous holder's deadline. MemStore passes it; so must every other store.
//
// Package leadertest imports package testing, which is why it is a package
// of its own: nothing in package leader depends on it.
package leadertest
