package postgres

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/pgtest"
)

// TestNewConnectionsTryASilentHostLast runs each store on a connection
// string that lists, before the database's server, a host that accepts
// connections and never answers (a vanished server behind a load balancer,
// or a black-holed proxy), with connect_timeout=1. A connection tries the
// silent host for that second at most once: the store's later connections
// go to the server at once, opened for a new candidate (advisory) or after
// ResetConnections (lease). The silent host counts the connections it
// accepts: the later ones add none. (A bound on the later calls' time
// told the same, until a loaded machine took 938 ms to open an advisory
// session without the silent host.)
func TestNewConnectionsTryASilentHostLast(t *testing.T) {
	t.Parallel()
	server := pgtest.NewDatabase(t)
	silent, accepted := countingSilentServer(t)
	url := multiHostURL(t, server, silent, hostPort(t, server)) + "&connect_timeout=1"
	pool := pgtest.OpenPool(t, url)
	if err := Migrate(callCtx(t), pool, Options{}); err != nil {
		t.Fatal(err)
	}
	acquire := func(store leader.Store, name string, c leader.Candidate) time.Duration {
		t.Helper()
		start := time.Now()
		if _, _, err := store.Acquire(callCtx(t), name, c, time.Minute); err != nil {
			t.Fatalf("Acquire of %s by %s: %v", name, c.ID, err)
		}
		return time.Since(start)
	}
	// later checks that the calls of try open no connection on the
	// silent host.
	later := func(what string, try func()) {
		t.Helper()
		before := accepted()
		start := time.Now()
		try()
		if n := accepted() - before; n > 0 {
			t.Errorf("%s: %d connections tried the silent host again (in %v)", what, n, time.Since(start).Round(time.Millisecond))
		}
	}

	lease, err := NewLeaseStore(pool, Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(lease.Close)
	took := acquire(lease, "lease", candidate("a"))
	t.Logf("lease store: first Acquire took %v; the silent host accepted %d connections", took.Round(time.Millisecond), accepted())
	lease.ResetConnections()
	later("lease store: an Acquire on a new connection", func() { acquire(lease, "lease", candidate("b")) })

	advisory := setupAdvisory(t, pool, Options{}) // its check has met the silent host
	met := accepted()
	for _, id := range []string{"a", "b"} {
		later(fmt.Sprintf("advisory store: %s's Acquire, on a new session", id), func() { acquire(advisory, "advisory", candidate(id)) })
	}
	if met == 0 {
		t.Fatal("the silent host accepted no connection: the test tried none on it")
	}
	// Nor did a connection opened in the background after a call (a
	// listener's, a lock waiter's).
	time.Sleep(100 * time.Millisecond)
	if n := accepted() - met; n > 0 {
		t.Errorf("%d connections tried the silent host again after the advisory store had met it", n)
	}
}

// TestAShortDeadlineDoesNotCutASessionsConnectionShort gives an
// AdvisoryStore a server that takes longer to accept a connection than
// each Acquire may take. The session's connection (and the store's
// own pool's) is opened in the background, so that a later Acquire
// takes it: a connection opened within each call's deadline would never
// be.
func TestAShortDeadlineDoesNotCutASessionsConnectionShort(t *testing.T) {
	t.Parallel()
	const (
		delay    = 1500 * time.Millisecond
		deadline = time.Second
		attempts = 5
	)
	server := pgtest.NewDatabase(t)
	// The name is claimed for the strategy beforehand, which takes a
	// connection of the store's pool besides: its session's alone is
	// what this test is about.
	direct := setupAdvisory(t, pgtest.OpenPool(t, server), Options{})
	claimed := candidate("direct")
	l, _, err := direct.Acquire(callCtx(t), "slow", claimed, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := direct.Release(callCtx(t), "slow", claimed.Token, l.Term); err != nil {
		t.Fatal(err)
	}
	pool := pgtest.OpenPool(t, multiHostURL(t, server, slowServer(t, hostPort(t, server), delay)))
	store := setupAdvisory(t, pool, Options{})
	c := candidate("a")
	for i := range attempts {
		ctx, cancel := context.WithTimeout(t.Context(), deadline)
		_, granted, err := store.Acquire(ctx, "slow", c, time.Minute)
		cancel()
		switch {
		case granted:
			t.Logf("granted at attempt %d", i+1)
			return
		case err != nil && !errors.Is(err, context.DeadlineExceeded):
			t.Fatalf("Acquire: %v", err)
		}
	}
	t.Fatalf("not granted in %d attempts of %v each, on a server that takes %v to accept a connection", attempts, deadline, delay)
}

// slowServer relays connections to upstream after holding each for delay,
// until t ends. It returns its address.
func slowServer(t *testing.T, upstream string, delay time.Duration) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		conns []net.Conn
	)
	track := func(c net.Conn) {
		mu.Lock()
		defer mu.Unlock()
		conns = append(conns, c)
	}
	done := make(chan struct{})
	t.Cleanup(func() {
		close(done)
		l.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Go(func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			track(c)
			wg.Go(func() {
				select {
				case <-time.After(delay):
				case <-done:
					c.Close()
					return
				}
				u, err := net.Dial("tcp", upstream)
				if err != nil {
					c.Close()
					return
				}
				track(u)
				wg.Go(func() { _, _ = io.Copy(u, c); u.Close() })
				_, _ = io.Copy(c, u)
				c.Close()
			})
		}
	})
	return l.Addr().String()
}
