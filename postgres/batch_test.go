package postgres

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/internal/pgtest"
)

// statementCounter is a pgx tracer that counts the statements sent whose
// SQL contains a marker.
type statementCounter struct {
	marker string
	n      atomic.Int64
}

func (c *statementCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, c.marker) {
		c.n.Add(1)
	}
	return ctx
}

func (c *statementCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// countingPool returns a pool on a fresh database that counts the renewal
// statements it sends.
func countingPool(t *testing.T) (*pgxpool.Pool, *statementCounter) {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.NewDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	counter := &statementCounter{marker: "unnest("}
	cfg.ConnConfig.Tracer = counter
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool, counter
}

// A process that holds many names renews them all with one statement per
// round, and none of them is lost.
func TestManyNamesAreRenewedWithOneStatementPerRound(t *testing.T) {
	const (
		names  = 300
		ttl    = 3 * time.Second // renew rounds every second
		window = 4 * time.Second
	)
	pool, counter := countingPool(t)
	b := setupOn(t, pool, Options{})
	var lost atomic.Int64
	electors := make([]*leader.Elector, names)
	for i := range electors {
		e, err := leader.New(b.store, leader.Config{
			Name: fmt.Sprintf("name-%03d", i), ID: "holder", TTL: ttl, Logger: slog.New(slog.DiscardHandler),
			OnDemoted: func() { lost.Add(1) },
		})
		if err != nil {
			t.Fatal(err)
		}
		electors[i] = e
		t.Cleanup(electortest.Run(t, e))
	}
	electortest.Eventually(t, 30*time.Second, "every name led", func() bool {
		return len(electortest.Leaders(electors)) == names
	})
	// Two renew intervals: every Elector has renewed once on the grid.
	time.Sleep(2 * ttl / 3)

	before := counter.n.Load()
	time.Sleep(window)
	statements := counter.n.Load() - before
	rounds := int64(window / (ttl / 3))
	t.Logf("%d names: %d renewal statements in %v (%d rounds)", names, statements, window, rounds)
	// A round that straddles the window's edges counts once more, and a
	// round may split in two when a loaded machine stalls its Electors'
	// wake-ups (every one of them, at worst); without batching it would
	// be names×rounds.
	if statements > 2*rounds+2 {
		t.Errorf("%d renewal statements in %d rounds for %d names; want one per round", statements, rounds, names)
	}
	if statements < rounds-1 {
		t.Errorf("%d renewal statements in %d rounds: the names are not being renewed", statements, rounds)
	}
	if n := lost.Load(); n != 0 {
		t.Errorf("%d of %d names lost while renewing in batches", n, names)
	}
	if n := len(electortest.Leaders(electors)); n != names {
		t.Errorf("%d of %d names still led", n, names)
	}
}

// In a batch, a lease that is no longer held is reported lost and the
// others are renewed; a call whose context has ended gets its context's
// error and does not hold up the rest.
func TestBatchedRenewalsAreJudgedOneByOne(t *testing.T) {
	b := setup(t)
	ctx := callCtx(t)
	const ttl = 10 * time.Second
	type held struct {
		name  string
		c     leader.Candidate
		term  uint64
		lease leader.Lease
		err   error
	}
	leases := []*held{{name: "kept-1"}, {name: "stolen"}, {name: "kept-2"}}
	for _, h := range leases {
		h.c = candidate("holder")
		l, ok, err := b.store.Acquire(ctx, h.name, h.c, ttl)
		if err != nil || !ok {
			t.Fatalf("Acquire %s: granted %v, %v", h.name, ok, err)
		}
		h.term = l.Term
	}
	// Another instance takes "stolen" over behind the store's back.
	if _, err := b.pool.Exec(ctx, `UPDATE leader_leases SET holder_token = 'other', term = term + 1 WHERE name = 'stolen'`); err != nil {
		t.Fatal(err)
	}

	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	var wg sync.WaitGroup
	for _, h := range leases {
		wg.Go(func() { h.lease, h.err = b.store.Renew(ctx, h.name, h.c.Token, h.term, ttl) })
	}
	var cancelledErr error
	wg.Go(func() { _, cancelledErr = b.store.Renew(cancelled, "kept-1", leases[0].c.Token, leases[0].term, ttl) })
	wg.Wait()

	for _, h := range leases {
		switch {
		case h.name == "stolen" && !errors.Is(h.err, leader.ErrLeaseLost):
			t.Errorf("Renew %s: %v; want ErrLeaseLost", h.name, h.err)
		case h.name != "stolen" && h.err != nil:
			t.Errorf("Renew %s: %v", h.name, h.err)
		case h.name != "stolen" && (h.lease.Term != h.term || h.lease.HolderID != "holder" || h.lease.Remaining <= 0 || h.lease.Remaining > ttl):
			t.Errorf("Renew %s: %+v; want held by holder under term %d with up to %v left", h.name, h.lease, h.term, ttl)
		}
	}
	if !errors.Is(cancelledErr, context.Canceled) {
		t.Errorf("Renew with a cancelled context: %v; want context.Canceled", cancelledErr)
	}
}
