package leaderhttp_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/leaderhttp"
	"github.com/leaderelect/leader/leaderprom"
	"github.com/leaderelect/leader/leadertest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

const ttl = time.Second // the shortest TTL leader.New accepts

// clock is a settable time source for Options.Now.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *clock) Set(t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = t
}

// bundle is what setup returns besides the server.
type bundle struct {
	elector *leader.Elector
	clock   *clock
	srv     *httptest.Server
}

// setup returns an Elector on store (not running) and a test server for its
// Handler; opts.Now is set to a fake clock starting at the real time unless
// the caller set it.
func setup(t *testing.T, store leader.Store, opts leaderhttp.Options) *bundle {
	t.Helper()
	e, err := leader.New(store, leader.Config{
		Name: "nightly-report", ID: "worker-1", TTL: ttl,
		Logger: slog.New(slog.DiscardHandler),
	})
	if err != nil {
		t.Fatalf("leader.New: %v", err)
	}
	c := &clock{now: time.Now()}
	if opts.Now == nil {
		opts.Now = c.Now
	}
	srv := httptest.NewServer(leaderhttp.Handler(e, opts))
	t.Cleanup(srv.Close)
	return &bundle{elector: e, clock: c, srv: srv}
}

// run runs the Elector until the returned stop is called or the test ends.
func (b *bundle) run(t *testing.T) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := b.elector.Run(ctx); err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(stop)
	return stop
}

// get requests path and returns the status code, body and Content-Type.
func (b *bundle) get(t *testing.T, method, path string) (int, string, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), method, b.srv.URL+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := b.srv.Client().Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: reading body: %v", method, path, err)
	}
	return resp.StatusCode, string(body), resp.Header.Get("Content-Type")
}

// eventually polls cond until it holds, failing the test after 5s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// unreachableStore fails every call, as a store behind a broken network does
// (it embeds the interface, so none of the MemStore's optional interfaces
// answers either).
type unreachableStore struct{ leader.Store }

func (unreachableStore) Acquire(context.Context, string, leader.Candidate, time.Duration) (leader.Lease, bool, error) {
	return leader.Lease{}, false, fmt.Errorf("dial: connection refused: %w", leader.ErrUnavailable)
}

// misconfiguredStore grants the first Acquire, then refuses every call
// with leader.ErrPermanent while broken is set, as a store whose grants a
// DBA revoked does.
type misconfiguredStore struct {
	*leadertest.MemStore
	broken atomic.Bool
}

var errRevoked = fmt.Errorf("permission denied for table leader_leases: GRANT it: %w", leader.ErrPermanent)

func (s *misconfiguredStore) Acquire(ctx context.Context, name string, c leader.Candidate, ttl time.Duration) (leader.Lease, bool, error) {
	if s.broken.Load() {
		return leader.Lease{}, false, errRevoked
	}
	return s.MemStore.Acquire(ctx, name, c, ttl)
}

func (s *misconfiguredStore) Renew(ctx context.Context, name, token string, term uint64, ttl time.Duration) (leader.Lease, error) {
	if s.broken.Load() {
		return leader.Lease{}, errRevoked
	}
	return s.MemStore.Renew(ctx, name, token, term, ttl)
}

func (s *misconfiguredStore) Enlist(ctx context.Context, name string, c leader.Candidate, ttl time.Duration) error {
	if s.broken.Load() {
		return errRevoked
	}
	return s.MemStore.Enlist(ctx, name, c, ttl)
}

func (s *misconfiguredStore) RenewBatch(ctx context.Context, batch []leader.Renewal) {
	if !s.broken.Load() {
		s.MemStore.RenewBatch(ctx, batch)
		return
	}
	for i := range batch {
		batch[i].Err = errRevoked
	}
}

func TestHealthz(t *testing.T) {
	t.Parallel()
	limit := ttl + ttl/3 // the default MaxSilence: TTL + RenewInterval

	t.Run("a store that refuses with a permanent error is reported at once, until mended", func(t *testing.T) {
		t.Parallel()
		store := &misconfiguredStore{MemStore: leadertest.NewMemStore()}
		b := setup(t, store, leaderhttp.Options{})
		b.run(t)
		eventually(t, "leadership", b.elector.IsLeader)
		store.broken.Store(true)
		eventually(t, "a 503 naming the store's error", func() bool {
			code, body, _ := b.get(t, "GET", "/healthz")
			return code == http.StatusServiceUnavailable && strings.Contains(body, "GRANT it")
		})
		store.broken.Store(false)
		eventually(t, "a 200 once the store answers again", func() bool {
			code, _, _ := b.get(t, "GET", "/healthz")
			return code == http.StatusOK
		})
	})

	t.Run("a running elector is healthy", func(t *testing.T) {
		t.Parallel()
		b := setup(t, leadertest.NewMemStore(), leaderhttp.Options{Now: time.Now})
		b.run(t)
		eventually(t, "leadership", b.elector.IsLeader)
		code, body, ctype := b.get(t, "GET", "/healthz")
		if code != http.StatusOK || body != "ok\n" {
			t.Errorf("GET /healthz = %d %q, want 200 \"ok\\n\"", code, body)
		}
		if !strings.HasPrefix(ctype, "text/plain") {
			t.Errorf("Content-Type = %q, want text/plain", ctype)
		}
	})

	t.Run("a silent elector is wedged once the last contact is older than the limit", func(t *testing.T) {
		t.Parallel()
		b := setup(t, leadertest.NewMemStore(), leaderhttp.Options{})
		stop := b.run(t)
		eventually(t, "leadership", b.elector.IsLeader)
		stop() // no more store calls: LastContact stays put
		last := b.elector.Status().LastContact
		if last.IsZero() {
			t.Fatal("LastContact is zero after leading")
		}

		b.clock.Set(last.Add(limit))
		if code, body, _ := b.get(t, "GET", "/healthz"); code != http.StatusOK {
			t.Errorf("at exactly the limit: GET /healthz = %d %q, want 200", code, body)
		}
		b.clock.Set(last.Add(limit + time.Millisecond))
		code, body, _ := b.get(t, "GET", "/healthz")
		if code != http.StatusServiceUnavailable {
			t.Errorf("past the limit: GET /healthz = %d %q, want 503", code, body)
		}
		if !strings.Contains(body, "no successful store call for 1.334s (limit 1.333333333s)") {
			t.Errorf("503 body %q does not say how long the store has been silent", body)
		}
	})

	t.Run("an elector that never reached its store is wedged one limit after the handler started", func(t *testing.T) {
		t.Parallel()
		store := unreachableStore{leadertest.NewMemStore()}
		b := setup(t, store, leaderhttp.Options{})
		start := b.clock.Now()
		b.run(t)

		if code, body, _ := b.get(t, "GET", "/healthz"); code != http.StatusOK {
			t.Errorf("while starting: GET /healthz = %d %q, want 200", code, body)
		}
		b.clock.Set(start.Add(limit))
		if code, body, _ := b.get(t, "GET", "/healthz"); code != http.StatusOK {
			t.Errorf("at exactly the limit: GET /healthz = %d %q, want 200", code, body)
		}
		b.clock.Set(start.Add(limit + time.Millisecond))
		code, body, _ := b.get(t, "GET", "/healthz")
		if code != http.StatusServiceUnavailable || !strings.Contains(body, "since the health handler started") {
			t.Errorf("past the limit: GET /healthz = %d %q, want 503 saying no call succeeded since start", code, body)
		}
		if !b.elector.Status().LastContact.IsZero() {
			t.Error("LastContact set although every store call failed")
		}
	})

	t.Run("an elector whose Run was never called is wedged too", func(t *testing.T) {
		t.Parallel()
		b := setup(t, leadertest.NewMemStore(), leaderhttp.Options{})
		b.clock.Set(b.clock.Now().Add(limit + time.Millisecond))
		if code, body, _ := b.get(t, "GET", "/healthz"); code != http.StatusServiceUnavailable {
			t.Errorf("GET /healthz = %d %q, want 503", code, body)
		}
	})

	t.Run("MaxSilence sets the limit", func(t *testing.T) {
		t.Parallel()
		b := setup(t, leadertest.NewMemStore(), leaderhttp.Options{MaxSilence: 10 * time.Second})
		start := b.clock.Now()
		b.clock.Set(start.Add(10 * time.Second))
		if code, body, _ := b.get(t, "GET", "/healthz"); code != http.StatusOK {
			t.Errorf("at 10s: GET /healthz = %d %q, want 200", code, body)
		}
		b.clock.Set(start.Add(10*time.Second + time.Millisecond))
		if code, body, _ := b.get(t, "GET", "/healthz"); code != http.StatusServiceUnavailable {
			t.Errorf("past 10s: GET /healthz = %d %q, want 503", code, body)
		}
	})
}

func TestLeader(t *testing.T) {
	t.Parallel()

	t.Run("reports the status of a leading elector as JSON", func(t *testing.T) {
		t.Parallel()
		b := setup(t, leadertest.NewMemStore(), leaderhttp.Options{})
		b.run(t)
		eventually(t, "leadership", b.elector.IsLeader)

		code, body, ctype := b.get(t, "GET", "/leader")
		if code != http.StatusOK {
			t.Fatalf("GET /leader = %d %q, want 200", code, body)
		}
		if ctype != "application/json" {
			t.Errorf("Content-Type = %q, want application/json", ctype)
		}
		var keys map[string]any
		if err := json.Unmarshal([]byte(body), &keys); err != nil {
			t.Fatalf("body is not a JSON object: %v\n%s", err, body)
		}
		for _, k := range []string{"name", "id", "is_leader", "leader", "term", "acquired_at", "expires_at", "last_contact", "ttl_seconds"} {
			if _, ok := keys[k]; !ok {
				t.Errorf("key %q missing from %s", k, body)
			}
		}
		var got struct {
			leader.Status
			TTLSeconds float64 `json:"ttl_seconds"`
		}
		if err := json.Unmarshal([]byte(body), &got); err != nil {
			t.Fatal(err)
		}
		if got.Name != "nightly-report" || got.ID != "worker-1" || !got.IsLeader || got.Leader != "worker-1" {
			t.Errorf("name, id, is_leader, leader = %q, %q, %v, %q; want nightly-report, worker-1, true, worker-1",
				got.Name, got.ID, got.IsLeader, got.Leader)
		}
		if got.Term == 0 || got.AcquiredAt.IsZero() || got.ExpiresAt.IsZero() || got.LastContact.IsZero() {
			t.Errorf("term, acquired_at, expires_at, last_contact = %v, %v, %v, %v; want all set",
				got.Term, got.AcquiredAt, got.ExpiresAt, got.LastContact)
		}
		if got.TTLSeconds != 1 {
			t.Errorf("ttl_seconds = %v, want 1", got.TTLSeconds)
		}
	})

	t.Run("reports a follower with the observed leader", func(t *testing.T) {
		t.Parallel()
		store := leadertest.NewMemStore()
		other, err := leader.New(store, leader.Config{
			Name: "nightly-report", ID: "worker-2", TTL: ttl, Logger: slog.New(slog.DiscardHandler),
		})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); other.Run(ctx) }()
		t.Cleanup(func() { cancel(); <-done })
		eventually(t, "worker-2 leading", other.IsLeader)

		b := setup(t, store, leaderhttp.Options{})
		b.run(t)
		eventually(t, "worker-1 observing worker-2", func() bool { return b.elector.Status().Leader == "worker-2" })

		_, body, _ := b.get(t, "GET", "/leader")
		var got leader.Status
		if err := json.Unmarshal([]byte(body), &got); err != nil {
			t.Fatal(err)
		}
		if got.IsLeader || got.ID != "worker-1" || got.Leader != "worker-2" {
			t.Errorf("is_leader, id, leader = %v, %q, %q; want false, worker-1, worker-2", got.IsLeader, got.ID, got.Leader)
		}
	})
}

func TestMetrics(t *testing.T) {
	t.Parallel()

	t.Run("serves the gatherer when one is given", func(t *testing.T) {
		t.Parallel()
		reg := prometheus.NewRegistry()
		m, err := leaderprom.New(reg)
		if err != nil {
			t.Fatal(err)
		}
		m.StatusChanged("nightly-report", true)
		b := setup(t, leadertest.NewMemStore(), leaderhttp.Options{Gatherer: reg})
		code, body, _ := b.get(t, "GET", "/metrics")
		if code != http.StatusOK || !strings.Contains(body, `leader_is_leader{election="nightly-report"} 1`) {
			t.Errorf("GET /metrics = %d, body:\n%s\nwant 200 with leader_is_leader 1", code, body)
		}
	})

	t.Run("answers 404 without a gatherer", func(t *testing.T) {
		t.Parallel()
		b := setup(t, leadertest.NewMemStore(), leaderhttp.Options{})
		if code, body, _ := b.get(t, "GET", "/metrics"); code != http.StatusNotFound {
			t.Errorf("GET /metrics = %d %q, want 404", code, body)
		}
	})
}

func TestRouting(t *testing.T) {
	t.Parallel()
	b := setup(t, leadertest.NewMemStore(), leaderhttp.Options{})
	for _, tc := range []struct {
		method, path string
		want         int
	}{
		{"GET", "/", http.StatusNotFound},
		{"GET", "/healthz/extra", http.StatusNotFound},
		{"POST", "/healthz", http.StatusMethodNotAllowed},
		{"DELETE", "/leader", http.StatusMethodNotAllowed},
		{"HEAD", "/healthz", http.StatusOK},
	} {
		if code, _, _ := b.get(t, tc.method, tc.path); code != tc.want {
			t.Errorf("%s %s = %d, want %d", tc.method, tc.path, code, tc.want)
		}
	}
}

func TestHandlerPanicsOnNilElector(t *testing.T) {
	t.Parallel()
	defer func() {
		if recover() == nil {
			t.Error("Handler(nil, ...) did not panic")
		}
	}()
	leaderhttp.Handler(nil, leaderhttp.Options{})
}
