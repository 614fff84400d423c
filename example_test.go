package leader_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/leadertest"
)

// Lead a cron job: the work runs only while this instance leads, and stops
// when leadership is lost. The in-memory store stands in for PostgreSQL here
// (see package postgres).
func Example() {
	store := leadertest.NewMemStore()
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	elected, stopped := make(chan struct{}), make(chan struct{})
	e, err := leader.New(store, leader.Config{
		Name:   "nightly-report",
		ID:     "worker-1",
		Logger: slog.New(slog.DiscardHandler),
		OnElected: func(ctx context.Context) {
			defer close(stopped)
			term, _ := leader.TermFrom(ctx)
			fmt.Println("elected, term", term)
			close(elected)
			<-ctx.Done() // run the reports until leadership ends
			fmt.Println("reports stopped:", context.Cause(ctx))
		},
		OnDemoted: func() {
			<-stopped // block until the work has stopped
			fmt.Println("demoted")
		},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	done := make(chan error)
	go func() { done <- e.Run(ctx) }()
	<-elected
	stop() // shut down: step down and hand over
	fmt.Println("Run returned", <-done)
	// Output:
	// elected, term 1
	// reports stopped: leader: not the leader: leadership lost (shutdown)
	// demoted
	// Run returned <nil>
}

// Guard a write with the fencing term, so that a deposed leader's late write
// is refused by the database instead of overwriting the new leader's.
func ExampleTermFrom() {
	// In the database: UPDATE report SET body = $1, term = $2 WHERE term <= $2
	lastTerm := uint64(0)
	write := func(ctx context.Context, body string) error {
		term, ok := leader.TermFrom(ctx)
		if !ok {
			return leader.ErrNotLeader
		}
		if term < lastTerm {
			return fmt.Errorf("write %q refused: term %d is older than %d", body, term, lastTerm)
		}
		lastTerm = term
		fmt.Printf("wrote %q under term %d\n", body, term)
		return nil
	}

	store := leadertest.NewMemStore()
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	wrote := make(chan error, 1)
	e, err := leader.New(store, leader.Config{
		Name:      "report-writer",
		Logger:    slog.New(slog.DiscardHandler),
		OnElected: func(ctx context.Context) { wrote <- write(ctx, "daily totals") },
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	go func() { _ = e.Run(ctx) }()
	if err := <-wrote; err != nil {
		fmt.Println(err)
	}
	fmt.Println(write(context.Background(), "from a follower"))
	// Output:
	// wrote "daily totals" under term 1
	// leader: not the leader
}

// Run a function only while leading: followers get ErrNotLeader, and the
// function's context ends if leadership is lost while it runs.
func ExampleElector_RunIfLeader() {
	store := leadertest.NewMemStore()
	e, err := leader.New(store, leader.Config{Name: "cleanup", Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		fmt.Println(err)
		return
	}
	err = e.RunIfLeader(context.Background(), func(ctx context.Context) error {
		fmt.Println("cleaning up")
		return nil
	})
	fmt.Println(errors.Is(err, leader.ErrNotLeader))
	// Output:
	// true
}

// New refuses a bad Config with an error naming the field and the rule.
func ExampleNew_validation() {
	_, err := leader.New(leadertest.NewMemStore(), leader.Config{
		Name:          "jobs",
		TTL:           9_000_000_000, // 9s
		RenewInterval: 4_000_000_000, // 4s: more than TTL/3
	})
	fmt.Println(err)
	var ce *leader.ConfigError
	fmt.Println(errors.As(err, &ce), ce.Field)
	// Output:
	// leader: invalid Config.RenewInterval 4s: must be at most TTL/3 (3s)
	// true RenewInterval
}

// A store that implements BatchRenewer renews many leases with one call, each
// on its own terms. The Electors of a process call it for every lease they
// hold, once per renew round; here it is called directly, on the in-memory
// store, with one lease still held and one that was released.
func ExampleBatchRenewer() {
	ctx := context.Background()
	store := leadertest.NewMemStore()
	alice := leader.Candidate{ID: "alice", Token: "token-a"}
	report, _, _ := store.Acquire(ctx, "report", alice, time.Minute)
	cleanup, _, _ := store.Acquire(ctx, "cleanup", alice, time.Minute)
	_ = store.Release(ctx, "cleanup", alice.Token, cleanup.Term)

	batch := []leader.Renewal{
		{Name: "report", Token: alice.Token, Term: report.Term, TTL: time.Minute},
		{Name: "cleanup", Token: alice.Token, Term: cleanup.Term, TTL: time.Minute},
	}
	var br leader.BatchRenewer = store
	br.RenewBatch(ctx, batch)
	for _, r := range batch {
		fmt.Printf("%s: renewed %v, lost %v\n", r.Name, r.Err == nil, errors.Is(r.Err, leader.ErrLeaseLost))
	}
	// Output:
	// report: renewed true, lost false
	// cleanup: renewed false, lost true
}

// campaigning waits until a candidate with the given ID is enlisted.
func campaigning(ctx context.Context, store *leadertest.MemStore, name, id string) {
	for {
		cands, _ := store.Candidates(ctx, name)
		for _, c := range cands {
			if c.ID == id {
				return
			}
		}
		time.Sleep(time.Millisecond)
	}
}

// Hand leadership to a chosen candidate: the leader steps down (its
// context is cancelled and OnDemoted awaited), then the successor takes
// the lease at once with the next term, while the other candidates wait.
func ExampleElector_Transfer() {
	store := leadertest.NewMemStore()
	ctx, stop := context.WithCancel(context.Background())
	var running sync.WaitGroup
	defer running.Wait()
	defer stop()
	elected := make(chan string, 2)
	start := func(id string) *leader.Elector {
		e, err := leader.New(store, leader.Config{
			Name:      "nightly-report",
			ID:        id,
			Logger:    slog.New(slog.DiscardHandler),
			OnElected: func(context.Context) { elected <- id },
		})
		if err != nil {
			panic(err)
		}
		running.Go(func() { _ = e.Run(ctx) })
		return e
	}
	first := start("worker-1")
	fmt.Println("elected:", <-elected)
	start("worker-2")
	campaigning(ctx, store, "nightly-report", "worker-2")
	l, err := first.Transfer(ctx, "worker-2")
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("elected:", <-elected)
	fmt.Println("holder:", l.HolderID, "term:", l.Term, "reason:", l.Reason)
	// Output:
	// elected: worker-1
	// elected: worker-2
	// holder: worker-2 term: 2 reason: transfer
}

// Ask whoever leads to hand over, from any process: no Elector needed.
// Without a candidate ID the leader picks the candidate with the highest
// Config.Priority (here the only other one).
func ExampleRequestTransfer() {
	store := leadertest.NewMemStore()
	ctx, stop := context.WithCancel(context.Background())
	var running sync.WaitGroup
	defer running.Wait()
	defer stop()
	elected := make(chan string, 2)
	for i, id := range []string{"old-release", "new-release"} {
		e, err := leader.New(store, leader.Config{
			Name:      "nightly-report",
			ID:        id,
			Logger:    slog.New(slog.DiscardHandler),
			OnElected: func(context.Context) { elected <- id },
		})
		if err != nil {
			panic(err)
		}
		running.Go(func() { _ = e.Run(ctx) })
		if i == 0 {
			fmt.Println("elected:", <-elected)
		}
	}
	campaigning(ctx, store, "nightly-report", "new-release")
	l, err := leader.RequestTransfer(ctx, store, "nightly-report", "")
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("elected:", <-elected)
	fmt.Println("holder:", l.HolderID, "reason:", l.Reason)
	// Output:
	// elected: old-release
	// elected: new-release
	// holder: new-release reason: transfer
}
