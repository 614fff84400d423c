package postgres_test

import (
	"context"
	"fmt"
	"log"
	"log/slog"
	"strconv"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/postgres"
)

// Every instance of a billing service registers the same handlers; the one
// that leads serves them from OnElected, and any instance sends. A durable
// message waits in the message table until a leader's handler has returned
// nil, so it is delivered even when it is sent before anyone leads, as here.
func ExampleRouter() {
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

	router, err := postgres.NewRouter(pool, postgres.Options{})
	if err != nil {
		log.Fatal(err)
	}
	err = router.Handle("invoices", func(ctx context.Context, m postgres.Message) error {
		fmt.Printf("the leader handles %q (durable: %v)\n", m.Payload, m.Durable)
		stop() // a real service serves until its leadership ends
		return nil
	})
	if err != nil {
		log.Fatal(err)
	}

	// Any instance can send, leader or not.
	if err := router.NotifyDurable(ctx, "invoices", "invoice 42 is due"); err != nil {
		log.Fatal(err)
	}

	elector, err := leader.New(store, leader.Config{
		Name:   "billing",
		ID:     "worker-1",
		Logger: slog.New(slog.DiscardHandler),
		OnElected: func(ctx context.Context) {
			// Serve returns when leadership ends; OnDemoted waits for it.
			if err := router.Serve(ctx); err != nil {
				log.Print(err)
			}
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := elector.Run(ctx); err != nil {
		log.Fatal(err)
	}
	// Output: the leader handles "invoice 42 is due" (durable: true)
}

// An outbox: the order and the message that asks the leader to ship it are
// committed together, or not at all. A rolled-back transaction leaves no
// message behind.
func ExampleRouter_NotifyDurableTx() {
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
	if _, err := pool.Exec(ctx, `CREATE TABLE orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, item text NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	router, err := postgres.NewRouter(pool, postgres.Options{})
	if err != nil {
		log.Fatal(err)
	}

	// placeOrder stores an order and, in the same transaction, the
	// message for the leader.
	placeOrder := func(item string, commit bool) error {
		tx, err := pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback(ctx) }() // a no-op after Commit
		var id int64
		if err := tx.QueryRow(ctx, `INSERT INTO orders (item) VALUES ($1) RETURNING id`, item).Scan(&id); err != nil {
			return err
		}
		if err := router.NotifyDurableTx(ctx, tx, "ship", strconv.FormatInt(id, 10)); err != nil {
			return err
		}
		if !commit {
			return nil // rolled back: neither the order nor the message exists
		}
		return tx.Commit(ctx)
	}
	if err := placeOrder("a teapot", false); err != nil {
		log.Fatal(err)
	}
	if err := placeOrder("a kettle", true); err != nil {
		log.Fatal(err)
	}

	err = router.Handle("ship", func(ctx context.Context, m postgres.Message) error {
		id, err := strconv.ParseInt(m.Payload, 10, 64)
		if err != nil {
			return err
		}
		var item string
		if err := pool.QueryRow(ctx, `SELECT item FROM orders WHERE id = $1`, id).Scan(&item); err != nil {
			return err // delivered again later
		}
		fmt.Printf("shipping order %d: %s\n", id, item)
		stop()
		return nil
	})
	if err != nil {
		log.Fatal(err)
	}
	store, err := postgres.NewLeaseStore(pool, postgres.Options{})
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
	elector, err := leader.New(store, leader.Config{
		Name:      "shipping",
		Logger:    slog.New(slog.DiscardHandler),
		OnElected: func(ctx context.Context) { _ = router.Serve(ctx) },
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := elector.Run(ctx); err != nil {
		log.Fatal(err)
	}
	// Output: shipping order 2: a kettle
}

// Best-effort messages are plain PostgreSQL notifications on the channel
// of the same name, so a trigger can send them as well as Notify. They are
// dropped when no leader is listening at that moment, so they suit hints
// that lose nothing when missed, such as invalidating the leader's cache.
// (No output is checked: whether a message arrives depends on when it is
// sent.)
func ExampleRouter_Notify() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, databaseURL())
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	// Every change to a setting tells the leader, whoever changed it.
	_, err = pool.Exec(ctx, `
CREATE TABLE settings (key text PRIMARY KEY, value text NOT NULL);
CREATE FUNCTION settings_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	PERFORM pg_notify('settings', NEW.key);
	RETURN NULL;
END $$;
CREATE TRIGGER settings_changed AFTER INSERT OR UPDATE ON settings
	FOR EACH ROW EXECUTE FUNCTION settings_changed();`)
	if err != nil {
		log.Fatal(err)
	}

	router, err := postgres.NewRouter(pool, postgres.Options{})
	if err != nil {
		log.Fatal(err)
	}
	err = router.Handle("settings", func(ctx context.Context, m postgres.Message) error {
		fmt.Println("the leader reloads setting", m.Payload)
		return nil
	})
	if err != nil {
		log.Fatal(err)
	}
	// ... the Elector's OnElected calls router.Serve(ctx), as in the
	// Router example.

	// From any instance: the trigger, or Notify.
	if _, err := pool.Exec(ctx, `INSERT INTO settings VALUES ('rate-limit', '100')`); err != nil {
		log.Fatal(err)
	}
	if err := router.Notify(ctx, "settings", "rate-limit"); err != nil {
		log.Fatal(err)
	}
	// So can psql; quote the name, as NOTIFY folds unquoted names to lower
	// case:
	//	NOTIFY "settings", 'rate-limit';
}
