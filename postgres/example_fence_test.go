package postgres_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/postgres"
)

// A leader's writes to the election's own database are fenced: its
// transaction calls Fence with the term it was elected under, and commits
// only while that term holds the lease. The writes of a leader whose
// process was paused past its lease, or whose connection was slow, are then
// refused once another instance leads, instead of overwriting the new
// leader's.
func ExampleFence() {
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
	if _, err := pool.Exec(ctx, `CREATE TABLE reports (day date PRIMARY KEY, written_by text NOT NULL, term bigint NOT NULL)`); err != nil {
		log.Fatal(err)
	}

	// writeReport is the leader's work, fenced with its term.
	writeReport := func(ctx context.Context, worker string, term uint64) error {
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if err := postgres.Fence(ctx, tx, postgres.Options{}, "nightly-report", term); err != nil {
				return err // BeginFunc rolls back
			}
			_, err := tx.Exec(ctx, `INSERT INTO reports VALUES ('2026-01-01', $1, $2)
				ON CONFLICT (day) DO UPDATE SET written_by = excluded.written_by, term = excluded.term`, worker, int64(term))
			return err
		})
	}

	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	elector, err := leader.New(store, leader.Config{
		Name:   "nightly-report",
		ID:     "worker-1",
		Logger: slog.New(slog.DiscardHandler),
		OnElected: func(ctx context.Context) {
			term, _ := leader.TermFrom(ctx)
			if err := writeReport(ctx, "worker-1", term); err != nil {
				log.Fatal(err)
			}
			fmt.Println("worker-1 wrote the report with term", term)
			stop()
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := elector.Run(runCtx); err != nil {
		log.Fatal(err)
	}

	// worker-2 leads next (its Elector makes this call; here it is made by
	// hand).
	worker2 := leader.Candidate{ID: "worker-2", Token: "a random per-instance token"}
	lease, _, err := store.Acquire(ctx, "nightly-report", worker2, time.Minute)
	if err != nil {
		log.Fatal(err)
	}
	if err := writeReport(ctx, "worker-2", lease.Term); err != nil {
		log.Fatal(err)
	}
	fmt.Println("worker-2 wrote the report with term", lease.Term)

	// worker-1's write of term 1 comes late: its process was paused.
	err = writeReport(ctx, "worker-1", 1)
	fmt.Println("worker-1's late write refused:", errors.Is(err, leader.ErrLeaseLost))

	var worker string
	var term int64
	if err := pool.QueryRow(ctx, `SELECT written_by, term FROM reports`).Scan(&worker, &term); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("the report is %s's, of term %d\n", worker, term)
	// Output:
	// worker-1 wrote the report with term 1
	// worker-2 wrote the report with term 2
	// worker-1's late write refused: true
	// the report is worker-2's, of term 2
}

// Programs in other languages, such as the commands that the leader
// command runs (which get LEADER_NAME and LEADER_TERM), fence their
// transactions with the fence function that Migrate creates. Here Go sends
// the script that psql -v ON_ERROR_STOP=1 -c "..." would send.
func ExampleFenceFunction() {
	ctx := context.Background()
	url := databaseURL()
	pool, err := pgxpool.New(ctx, url)
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
	if _, err := pool.Exec(ctx, `CREATE TABLE synced (term bigint NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	worker := leader.Candidate{ID: "worker-7", Token: "a random per-instance token"}
	if _, _, err := store.Acquire(ctx, "hourly-sync", worker, time.Minute); err != nil { // term 1
		log.Fatal(err)
	}
	fmt.Println(postgres.FenceFunction(postgres.Options{}))

	child, err := pgx.Connect(ctx, url)
	if err != nil {
		log.Fatal(err)
	}
	defer child.Close(ctx)
	for _, term := range []int{1, 2} { // as in LEADER_TERM
		script := fmt.Sprintf(`BEGIN; SELECT leader_leases_fence('hourly-sync', %d); INSERT INTO synced VALUES (%d); COMMIT;`, term, term)
		_, err := child.PgConn().Exec(ctx, script).ReadAll()
		var pgErr *pgconn.PgError
		switch {
		case err == nil:
			fmt.Printf("term %d: committed\n", term)
		case errors.As(err, &pgErr) && pgErr.Code == postgres.FenceSQLState:
			fmt.Printf("term %d: %s %s\n", term, pgErr.Code, pgErr.Message)
			if _, err := child.Exec(ctx, "ROLLBACK"); err != nil { // psql would exit instead
				log.Fatal(err)
			}
		default:
			log.Fatal(err)
		}
	}
	// Output:
	// "public"."leader_leases_fence"
	// term 1: committed
	// term 2: LF001 term 2 does not hold the lease of election 'hourly-sync'
}
