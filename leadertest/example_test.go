package leadertest_test

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/leadertest"
)

// A unit test of code that leads: an Elector campaigns on a MemStore, the
// test waits for OnElected (a signal, not a sleep) and checks the Elector's
// view, then stops it.
func ExampleMemStore() {
	store := leadertest.NewMemStore()

	elected := make(chan uint64, 1)
	e, err := leader.New(store, leader.Config{
		Name:   "nightly-report",
		ID:     "worker-1",
		TTL:    leader.MinTTL,
		Logger: slog.New(slog.DiscardHandler),
		OnElected: func(ctx context.Context) {
			term, _ := leader.TermFrom(ctx)
			select {
			case elected <- term:
			default:
			}
			<-ctx.Done() // the leader work runs until leadership ends
		},
	})
	if err != nil {
		fmt.Println("New:", err)
		return
	}

	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()

	select {
	case term := <-elected:
		fmt.Println("elected with term", term)
	case <-time.After(10 * time.Second): // a bound on the wait, not a sleep
		fmt.Println("not elected")
	}
	st := e.Status()
	fmt.Println("is leader:", e.IsLeader(), "leader:", st.Leader)

	// The store agrees.
	lease, _ := store.Observe(context.Background(), "nightly-report")
	fmt.Println("store holder:", lease.HolderID, "term:", lease.Term)

	stop()
	fmt.Println("Run returned:", <-done)

	// Run released the lease on the way out.
	lease, _ = store.Observe(context.Background(), "nightly-report")
	fmt.Println("held after Run:", lease.Held())

	// Output:
	// elected with term 1
	// is leader: true leader: worker-1
	// store holder: worker-1 term: 1
	// Run returned: <nil>
	// held after Run: false
}

// A free-watcher wakes when a lease is released, not when it is granted:
// the Elector's followers watch this way, so a handover costs each of them
// one attempt.
func ExampleMemStore_WatchFree() {
	store := leadertest.NewMemStore()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	free, _ := store.WatchFree(ctx, "nightly-report")
	all, _ := store.Watch(ctx, "nightly-report")
	woken := func(ch <-chan struct{}) bool {
		select {
		case <-ch:
			return true
		default:
			return false
		}
	}

	alice := leader.Candidate{ID: "alice", Token: "alice-token"}
	l, _, _ := store.Acquire(ctx, "nightly-report", alice, time.Minute)
	fmt.Println("after the grant:", woken(free), woken(all))
	_ = store.Release(ctx, "nightly-report", alice.Token, l.Term)
	fmt.Println("after the release:", woken(free), woken(all))
	// Output:
	// after the grant: false true
	// after the release: true true
}
