package filelock_test

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/filelock"
	"github.com/leaderelect/leader/leadertest"
)

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) != "" {
		os.Exit(helperMain())
	}
	goleak.VerifyTestMain(m)
}

// waitTimeout bounds every wait for something that should happen soon.
const waitTimeout = 10 * time.Second

// open returns a Store on dir, closed when the test ends.
func open(t *testing.T, dir string, opts ...filelock.Option) *filelock.Store {
	t.Helper()
	s, err := filelock.Open(dir, opts...)
	if err != nil {
		t.Fatalf("Open(%q): %v", dir, err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return s
}

func newCandidate(id string) leader.Candidate {
	b := make([]byte, 16)
	_, _ = crand.Read(b)
	return leader.Candidate{ID: id, Token: hex.EncodeToString(b)}
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), waitTimeout)
	t.Cleanup(cancel)
	return ctx
}

func mustAcquire(t *testing.T, s leader.Store, name string, c leader.Candidate, ttl time.Duration) leader.Lease {
	t.Helper()
	l, granted, err := s.Acquire(ctxT(t), name, c, ttl)
	if err != nil {
		t.Fatalf("Acquire(%q, %s): %v", name, c.ID, err)
	}
	if !granted {
		t.Fatalf("Acquire(%q, %s) not granted; held by %q term %d for %v", name, c.ID, l.HolderID, l.Term, l.Remaining)
	}
	return l
}

func mustRefuse(t *testing.T, s leader.Store, name string, c leader.Candidate, ttl time.Duration) leader.Lease {
	t.Helper()
	l, granted, err := s.Acquire(ctxT(t), name, c, ttl)
	if err != nil {
		t.Fatalf("Acquire(%q, %s): %v", name, c.ID, err)
	}
	if granted {
		t.Fatalf("Acquire(%q, %s) granted term %d; the lease should be held", name, c.ID, l.Term)
	}
	return l
}

func mustObserve(t *testing.T, s leader.Store, name string) leader.Lease {
	t.Helper()
	l, err := s.Observe(ctxT(t), name)
	if err != nil {
		t.Fatalf("Observe(%q): %v", name, err)
	}
	return l
}

// acquireWithin retries Acquire until it is granted or within has passed.
func acquireWithin(t *testing.T, s leader.Store, name string, c leader.Candidate, ttl, within time.Duration) leader.Lease {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		l, granted, err := s.Acquire(ctxT(t), name, c, ttl)
		if err != nil {
			t.Fatalf("Acquire(%q, %s): %v", name, c.ID, err)
		}
		if granted {
			return l
		}
		if time.Now().After(deadline) {
			t.Fatalf("Acquire(%q, %s) not granted within %v; held by %q term %d for %v", name, c.ID, within, l.HolderID, l.Term, l.Remaining)
		}
		time.Sleep(5 * time.Millisecond) // poll interval, not a wait for an event
	}
}

func waitWake(t *testing.T, ch <-chan struct{}, within time.Duration, what string) time.Duration {
	t.Helper()
	start := time.Now()
	timer := time.NewTimer(within)
	defer timer.Stop()
	select {
	case _, ok := <-ch:
		if !ok {
			t.Fatalf("watch channel closed while waiting for a wake-up %s", what)
		}
	case <-timer.C:
		t.Fatalf("no wake-up within %v %s", within, what)
	}
	return time.Since(start)
}

func TestConformance(t *testing.T) {
	t.Parallel()
	leadertest.TestStore(t, func(t *testing.T) leader.Store {
		return open(t, t.TempDir())
	})
}

// TestConformanceSharedDir runs the suite with every store on one directory
// and many Store values per process, as several processes would use it.
func TestConformanceSharedDir(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	leadertest.TestStore(t, func(t *testing.T) leader.Store {
		return open(t, dir)
	})
}

func TestOpen(t *testing.T) {
	t.Parallel()
	t.Run("creates the directory with mode 0700", func(t *testing.T) {
		t.Parallel()
		dir := filepath.Join(t.TempDir(), "a", "b")
		open(t, dir)
		fi, err := os.Stat(dir)
		if err != nil {
			t.Fatal(err)
		}
		if perm := fi.Mode().Perm(); perm&0o077 != 0 {
			t.Errorf("directory mode %v; want no access for group and others", perm)
		}
	})
	t.Run("refuses a file", func(t *testing.T) {
		t.Parallel()
		path := filepath.Join(t.TempDir(), "file")
		if err := os.WriteFile(path, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if s, err := filelock.Open(path); err == nil {
			s.Close()
			t.Fatal("Open of a regular file succeeded")
		}
	})
	t.Run("refuses an empty dir and a bad poll interval", func(t *testing.T) {
		t.Parallel()
		if _, err := filelock.Open(""); err == nil {
			t.Error(`Open("") succeeded`)
		}
		if _, err := filelock.Open(t.TempDir(), filelock.WithPollInterval(0)); err == nil {
			t.Error("Open with a zero poll interval succeeded")
		}
	})
	t.Run("reports an absolute directory", func(t *testing.T) {
		t.Parallel()
		dir := t.TempDir()
		s := open(t, dir)
		if s.Dir() != dir {
			t.Errorf("Dir() = %q; want %q", s.Dir(), dir)
		}
	})
}

func TestTwoStoresInOneProcess(t *testing.T) {
	t.Parallel()
	t.Run("exclude each other and see each other's holder", func(t *testing.T) {
		t.Parallel()
		dir := t.TempDir()
		a, b := open(t, dir), open(t, dir)
		alice, bob := newCandidate("alice"), newCandidate("bob")
		held := mustAcquire(t, a, "job", alice, time.Minute)
		l := mustRefuse(t, b, "job", bob, time.Minute)
		if l.HolderID != "alice" || l.Term != held.Term || !l.Held() {
			t.Errorf("refused candidate told holder %q term %d held %v; want alice term %d held", l.HolderID, l.Term, l.Held(), held.Term)
		}
		if o := mustObserve(t, b, "job"); o.HolderID != "alice" || o.Term != held.Term {
			t.Errorf("Observe on the other store: holder %q term %d; want alice term %d", o.HolderID, o.Term, held.Term)
		}
	})
	t.Run("closing the holder's store frees the lease at once, as its process's exit would", func(t *testing.T) {
		t.Parallel()
		dir := t.TempDir()
		a, err := filelock.Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		b := open(t, dir)
		alice, bob := newCandidate("alice"), newCandidate("bob")
		held := mustAcquire(t, a, "job", alice, time.Hour)
		mustRefuse(t, b, "job", bob, time.Hour)
		if err := a.Close(); err != nil {
			t.Fatal(err)
		}
		if o := mustObserve(t, b, "job"); o.Held() || o.Term != held.Term {
			t.Errorf("Observe after the holder's store closed: holder %q term %d; want free with term %d", o.HolderID, o.Term, held.Term)
		}
		l := mustAcquire(t, b, "job", bob, time.Hour)
		if l.Term != held.Term+1 {
			t.Errorf("takeover term %d; want %d", l.Term, held.Term+1)
		}
		if _, _, err := a.Acquire(t.Context(), "job", alice, time.Hour); !errors.Is(err, filelock.ErrClosed) {
			t.Errorf("Acquire on a closed store: %v; want ErrClosed", err)
		}
	})
	t.Run("a watcher on another store wakes when the holder's store closes", func(t *testing.T) {
		t.Parallel()
		dir := t.TempDir()
		a, err := filelock.Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		b := open(t, dir, filelock.WithPollInterval(10*time.Millisecond))
		mustAcquire(t, a, "job", newCandidate("alice"), time.Hour)
		ch, err := b.Watch(t.Context(), "job")
		if err != nil {
			t.Fatal(err)
		}
		if err := a.Close(); err != nil {
			t.Fatal(err)
		}
		waitWake(t, ch, waitTimeout, "after the holder's store closed")
	})
}

// TestWatcherWakesAtExpiry: a watcher wakes when a lease held through
// another Store expires, soon after its expiry, whatever the poll interval.
func TestWatcherWakesAtExpiry(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	a := open(t, dir)
	s := open(t, dir, filelock.WithPollInterval(time.Hour))
	const ttl = 300 * time.Millisecond
	mustAcquire(t, a, "job", newCandidate("alice"), ttl)
	ch, err := s.Watch(t.Context(), "job")
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	for mustObserve(t, s, "job").Held() {
		waitWake(t, ch, ttl+waitTimeout-time.Since(start), "at the lease's expiry") // a poll would take an hour
	}
	t.Logf("watcher saw the lease (TTL %v) expire %v after it started watching", ttl, time.Since(start))
}

func TestExpiryWhileHolderLives(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	a, b, c := open(t, dir), open(t, dir), open(t, dir)
	alice, bob, carol := newCandidate("alice"), newCandidate("bob"), newCandidate("carol")
	const ttl = 300 * time.Millisecond

	old := mustAcquire(t, a, "job", alice, ttl)
	// alice's store keeps the leader lock, but alice stops renewing.
	l := acquireWithin(t, b, "job", bob, time.Hour, waitTimeout)
	if l.Term != old.Term+1 {
		t.Fatalf("grant after expiry has term %d; want %d", l.Term, old.Term+1)
	}
	if _, err := a.Renew(ctxT(t), "job", alice.Token, old.Term, ttl); !errors.Is(err, leader.ErrLeaseLost) {
		t.Fatalf("renewal by the expired holder: %v; want ErrLeaseLost", err)
	}
	// alice's store dropped the leader lock on learning the lease was
	// lost; closing it must not free bob's lease.
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if o := mustObserve(t, c, "job"); o.HolderID != "bob" || !o.Held() {
		t.Fatalf("after the old holder's store closed: holder %q held %v; want bob", o.HolderID, o.Held())
	}
	mustRefuse(t, c, "job", carol, time.Hour)

	// bob takes the leader lock at its renewal, so closing bob's store now
	// frees the lease at once.
	if _, err := b.Renew(ctxT(t), "job", bob.Token, l.Term, time.Hour); err != nil {
		t.Fatal(err)
	}
	mustRefuse(t, c, "job", carol, time.Hour)
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if got := mustAcquire(t, c, "job", carol, time.Hour); got.Term != l.Term+1 {
		t.Fatalf("takeover from bob has term %d; want %d", got.Term, l.Term+1)
	}
}

func TestTermPersists(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	alice := newCandidate("alice")
	var last uint64
	for round := range 3 {
		s, err := filelock.Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		if o := mustObserve(t, s, "job"); o.Term != last || o.Held() {
			t.Fatalf("round %d: reopened store reports term %d held %v; want term %d, free", round, o.Term, o.Held(), last)
		}
		l := mustAcquire(t, s, "job", alice, time.Hour)
		if l.Term != last+1 {
			t.Fatalf("round %d: grant has term %d; want %d", round, l.Term, last+1)
		}
		last = l.Term
		if round%2 == 0 {
			if err := s.Release(ctxT(t), "job", alice.Token, l.Term); err != nil {
				t.Fatal(err)
			}
		} // else abandoned: Close drops the leader lock like an exit
		if err := s.Close(); err != nil {
			t.Fatal(err)
		}
	}
}

func TestNames(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("ü", 100) // 200 bytes of UTF-8, 600 when %-encoded
	names := []string{
		"nightly-report", "Nightly-Report", "a/b/../c", "with space", "日本語",
		"..", ".", "", long, long + "x", "%41", "A", "~", "x.state", "x.leader.lock",
	}
	dir := t.TempDir()
	s := open(t, dir)
	for i, name := range names {
		l := mustAcquire(t, s, name, newCandidate("c"), time.Hour)
		if l.Term != 1 || l.Name != name {
			t.Errorf("name %d %q: first grant has name %q term %d; want term 1 (names must not share files)", i, name, l.Name, l.Term)
		}
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if e.IsDir() {
			t.Errorf("name made a subdirectory %q", e.Name())
		}
		if len(e.Name()) > 255 {
			t.Errorf("file name of %d bytes: %q", len(e.Name()), e.Name())
		}
	}
	got, err := s.Names()
	if err != nil {
		t.Fatal(err)
	}
	seen := make(map[string]bool)
	for _, n := range got {
		seen[n] = true
	}
	if len(got) != len(names) {
		t.Errorf("Names returned %d names; want %d", len(got), len(names))
	}
	for _, n := range names {
		if !seen[n] {
			t.Errorf("Names lacks %q", n)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "nightly-report.state")); err != nil {
		t.Errorf("plain name not kept under its own file name: %v", err)
	}
}

func TestCorruptState(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	s := open(t, dir)
	if err := os.WriteFile(filepath.Join(dir, "job.state"), []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, _, err := s.Acquire(ctxT(t), "job", newCandidate("alice"), time.Hour)
	if err == nil || !strings.Contains(err.Error(), "job.state") {
		t.Fatalf("Acquire over a corrupt state: %v; want an error naming the file", err)
	}
}

func TestCloseEndsWatches(t *testing.T) {
	t.Parallel()
	s, err := filelock.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	ch, err := s.Watch(t.Context(), "job")
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	timer := time.NewTimer(waitTimeout)
	defer timer.Stop()
	for open := true; open; {
		select {
		case _, open = <-ch:
		case <-timer.C:
			t.Fatal("watch channel still open after Close")
		}
	}
	if _, err := s.Watch(t.Context(), "job"); !errors.Is(err, filelock.ErrClosed) {
		t.Errorf("Watch after Close: %v; want ErrClosed", err)
	}
	if err := s.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// TestElectorsInOneProcess runs Electors on separate Stores over one
// directory and checks that one leads at a time and that a killed leader's
// Store (closed without releasing, as at SIGKILL) is replaced quickly.
func TestElectorsInOneProcess(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	const n = 3
	var (
		mu      sync.Mutex
		leading = make(map[int]bool)
		overlap bool
		elected = make(chan int, 16)
	)
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	stores := make([]*filelock.Store, n)
	defer func() {
		cancel()
		wg.Wait()
		for _, s := range stores {
			if s != nil {
				s.Close()
			}
		}
	}()
	for i := range n {
		s, err := filelock.Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		stores[i] = s
		e, err := leader.New(s, leader.Config{
			Name:   "job",
			ID:     "e" + string(rune('0'+i)),
			TTL:    time.Hour, // only the leader lock can explain a quick failover
			Logger: discardLogger(),
			OnElected: func(ctx context.Context) {
				mu.Lock()
				for j := range leading {
					if leading[j] {
						overlap = true
					}
				}
				leading[i] = true
				mu.Unlock()
				elected <- i
			},
			OnDemoted: func() {
				mu.Lock()
				leading[i] = false
				mu.Unlock()
			},
		})
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() { _ = e.Run(ctx) })
	}
	first := <-elected
	// Kill the first leader's store: its Elector keeps running but can no
	// longer renew; with a one-hour TTL it would believe it leads for long,
	// so stop counting it.
	mu.Lock()
	leading[first] = false
	mu.Unlock()
	start := time.Now()
	if err := stores[first].Close(); err != nil {
		t.Fatal(err)
	}
	timer := time.NewTimer(waitTimeout)
	defer timer.Stop()
	select {
	case next := <-elected:
		if next == first {
			t.Fatalf("elector %d elected again on a closed store", first)
		}
		t.Logf("failover after the leader's store closed: %v", time.Since(start))
	case <-timer.C:
		t.Fatalf("no new leader within %v after the leader's store closed", waitTimeout)
	}
	mu.Lock()
	defer mu.Unlock()
	if overlap {
		t.Error("two electors led at once")
	}
}

func BenchmarkRenew(b *testing.B) {
	s, err := filelock.Open(b.TempDir())
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	c := newCandidate("bench")
	l, _, err := s.Acquire(b.Context(), "job", c, time.Minute)
	if err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		if _, err := s.Renew(b.Context(), "job", c.Token, l.Term, time.Minute); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkAcquireRelease(b *testing.B) {
	s, err := filelock.Open(b.TempDir())
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	c := newCandidate("bench")
	for b.Loop() {
		l, _, err := s.Acquire(b.Context(), "job", c, time.Minute)
		if err != nil {
			b.Fatal(err)
		}
		if err := s.Release(b.Context(), "job", c.Token, l.Term); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkObserveHeldElsewhere(b *testing.B) {
	dir := b.TempDir()
	holder, err := filelock.Open(dir)
	if err != nil {
		b.Fatal(err)
	}
	defer holder.Close()
	s, err := filelock.Open(dir)
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	if _, _, err := holder.Acquire(b.Context(), "job", newCandidate("holder"), time.Minute); err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		if _, err := s.Observe(b.Context(), "job"); err != nil {
			b.Fatal(err)
		}
	}
}
