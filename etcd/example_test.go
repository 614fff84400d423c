package etcd_test

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/etcd"
)

// An Elector on etcd: it leads "nightly-report" once elected, and its Run
// releases the name when its context ends.
func Example() {
	// endpoint is the test's etcd server; "localhost:2379", say.
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{endpoint}, DialTimeout: 5 * time.Second})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cli.Close()
	store, err := etcd.New(cli, etcd.WithPrefix("example/"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer store.Close()

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	elector, err := leader.New(store, leader.Config{
		Name:   "nightly-report",
		TTL:    5 * time.Second, // etcd's leases last whole seconds
		Logger: slog.New(slog.DiscardHandler),
		OnElected: func(ctx context.Context) {
			term, _ := leader.TermFrom(ctx)
			fmt.Println("leading; fence writes with term", term > 0)
			cancel() // the report is done: stop, which releases
		},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	_ = elector.Run(ctx)

	l, err := store.Observe(context.Background(), "nightly-report")
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("held after Run:", l.Held())
	// Output:
	// leading; fence writes with term true
	// held after Run: false
}

// Many names on one Store share one etcd lease per TTL: a round of
// renewals is one keep-alive and one read, however many names.
func ExampleStore_RenewBatch() {
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{endpoint}, DialTimeout: 5 * time.Second})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cli.Close()
	store, err := etcd.New(cli, etcd.WithPrefix("example-batch/"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer store.Close()
	ctx := context.Background()
	me := leader.Candidate{ID: "worker-1", Token: "a-random-token-per-elector"}
	var batch []leader.Renewal
	for _, name := range []string{"shard-1", "shard-2", "shard-3"} {
		l, granted, err := store.Acquire(ctx, name, me, 10*time.Second)
		if err != nil || !granted {
			fmt.Println(name, granted, err)
			return
		}
		batch = append(batch, leader.Renewal{Name: name, Token: me.Token, Term: l.Term, TTL: 10 * time.Second})
	}
	store.RenewBatch(ctx, batch)
	for _, r := range batch {
		fmt.Println(r.Name, "renewed:", r.Err == nil)
		_ = store.Release(ctx, r.Name, r.Token, r.Term)
	}
	// Output:
	// shard-1 renewed: true
	// shard-2 renewed: true
	// shard-3 renewed: true
}
