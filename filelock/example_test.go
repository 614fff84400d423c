package filelock_test

import (
	"context"
	"fmt"
	"log"
	"log/slog"
	"os"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/filelock"
)

// Processes on one host elect a leader through a shared directory. Here one
// Elector leads once, then its context ends: it steps down and releases the
// lease, and the term stays in the directory for the next grant.
func Example() {
	dir, err := os.MkdirTemp("", "filelock-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)

	store, err := filelock.Open(dir)
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	elector, err := leader.New(store, leader.Config{
		Name:   "nightly-report",
		ID:     "worker-1",
		TTL:    15 * time.Second,
		Logger: slog.New(slog.DiscardHandler),
		OnElected: func(ctx context.Context) {
			term, _ := leader.TermFrom(ctx)
			lease, _ := store.Observe(ctx, "nightly-report")
			fmt.Printf("elected with term %d; the store says %s leads\n", term, lease.HolderID)
			cancel() // the work is done: stop campaigning
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := elector.Run(ctx); err != nil {
		log.Fatal(err)
	}

	lease, err := store.Observe(context.Background(), "nightly-report")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("after Run: held %v, term %d\n", lease.Held(), lease.Term)
	// Output:
	// elected with term 1; the store says worker-1 leads
	// after Run: held false, term 1
}

// A Store can be used directly, for instance by a status command.
func ExampleStore_Observe() {
	dir, err := os.MkdirTemp("", "filelock-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	store, err := filelock.Open(dir)
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()

	ctx := context.Background()
	worker := leader.Candidate{ID: "worker-1", Token: "a random token unique to this instance"}
	if _, granted, err := store.Acquire(ctx, "nightly-report", worker, time.Minute); err != nil || !granted {
		log.Fatal("not granted: ", err)
	}

	lease, err := store.Observe(ctx, "nightly-report")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%s leads %s with term %d for up to %v\n", lease.HolderID, lease.Name, lease.Term, lease.Remaining.Round(time.Minute))
	// Output:
	// worker-1 leads nightly-report with term 1 for up to 1m0s
}
