package postgres_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/pgtest"
	"github.com/leaderelect/leader/postgres"
)

// databaseURL stands for the program's own connection string, such as
// postgres://app@db.internal:5432/app. Here it is a fresh test database.
func databaseURL() string {
	url, err := pgtest.CreateDatabase(context.Background())
	if err != nil {
		log.Fatal(err)
	}
	return url
}

// A service elects one of its instances to run the nightly report: create the
// table (Migrate is idempotent, so running it at every start is fine for a
// role that may create tables; see Privileges in the package doc), make
// a store, and campaign. The leader work runs in OnElected until its context
// ends.
func Example() {
	ctx, stop := context.WithCancel(context.Background())
	defer stop()

	pool, err := pgxpool.New(ctx, databaseURL())
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	if err := postgres.Migrate(ctx, pool, postgres.Options{}); err != nil {
		log.Fatal(err)
	}
	store, err := postgres.NewLeaseStore(pool, postgres.Options{})
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()

	elector, err := leader.New(store, leader.Config{
		Name:   "nightly-report",
		ID:     "worker-1",
		Logger: slog.New(slog.DiscardHandler),
		OnElected: func(ctx context.Context) {
			term, _ := leader.TermFrom(ctx)
			fmt.Println("leading nightly-report, term", term)
			stop() // a real service works here until ctx ends
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := elector.Run(ctx); err != nil {
		log.Fatal(err)
	}
	// Output: leading nightly-report, term 1
}

// The lease table can live in a schema of its own; Migrate creates the
// schema if it is missing. Observe shows who leads without campaigning, as a
// status page would.
func ExampleMigrate() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, databaseURL())
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	opts := postgres.Options{Schema: "coordination", Table: "leases"}
	if err := postgres.Migrate(ctx, pool, opts); err != nil {
		log.Fatal(err)
	}
	store, err := postgres.NewLeaseStore(pool, opts)
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()

	// Electors normally make these calls; here one is made by hand.
	worker := leader.Candidate{ID: "worker-7", Token: "a random per-instance token"}
	if _, _, err := store.Acquire(ctx, "reconciler", worker, time.Minute); err != nil {
		log.Fatal(err)
	}

	lease, err := store.Observe(ctx, "reconciler")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%s is led by %s (term %d), notifications on channel %q\n",
		lease.Name, lease.HolderID, lease.Term, store.Options().Channel)
	// Output: reconciler is led by worker-7 (term 1), notifications on channel "coordination.leases"
}

// A process holding many names renews them with one statement per round:
// its Electors call RenewBatch once for all of their leases. Here it is
// called by hand for two leases, one of them with a term that is no longer
// current, which is refused while the other is renewed.
func ExampleLeaseStore_RenewBatch() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, databaseURL())
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if err := postgres.Migrate(ctx, pool, postgres.Options{}); err != nil {
		log.Fatal(err)
	}
	store, err := postgres.NewLeaseStore(pool, postgres.Options{})
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()

	worker := leader.Candidate{ID: "worker-7", Token: "a random per-instance token"}
	billing, _, err := store.Acquire(ctx, "billing", worker, time.Minute)
	if err != nil {
		log.Fatal(err)
	}
	mail, _, err := store.Acquire(ctx, "mail", worker, time.Minute)
	if err != nil {
		log.Fatal(err)
	}

	batch := []leader.Renewal{
		{Name: "billing", Token: worker.Token, Term: billing.Term, TTL: time.Minute},
		{Name: "mail", Token: worker.Token, Term: mail.Term - 1, TTL: time.Minute},
	}
	store.RenewBatch(ctx, batch)
	for _, r := range batch {
		if r.Err != nil {
			fmt.Printf("%s: not renewed (lease lost: %v)\n", r.Name, errors.Is(r.Err, leader.ErrLeaseLost))
			continue
		}
		fmt.Printf("%s: renewed, term %d, held by %s\n", r.Name, r.Lease.Term, r.Lease.HolderID)
	}
	// Output:
	// billing: renewed, term 1, held by worker-7
	// mail: not renewed (lease lost: true)
}
