package leader_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/leadertest"
)

// errMisconfigured is what a store returns for a misconfiguration.
var errMisconfigured = fmt.Errorf("store: authentication failed: fix the password: %w", leader.ErrPermanent)

// runUntilReturns runs e until Run returns or within passes, and returns
// Run's error, failing the test if it did not return.
func runUntilReturns(t *testing.T, e *leader.Elector, within time.Duration) error {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	select {
	case err := <-done:
		return err
	case <-time.After(within):
		cancel()
		<-done
		t.Fatalf("Run did not return within %v", within)
		return nil
	}
}

func TestPermanentErrors(t *testing.T) {
	t.Parallel()

	t.Run("before any contact Run returns a permanent error at once", func(t *testing.T) {
		t.Parallel()
		store := newFaultStore(leadertest.NewMemStore())
		store.set(func(f *faultStore) { f.failWith = errMisconfigured })
		cfg := testConfig("perm", "a")
		cfg.TTL, cfg.RetryInterval = 30*time.Second, 10*time.Second // a retry would make Run late
		e, err := leader.New(store, cfg)
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		err = runUntilReturns(t, e, 5*time.Second)
		if !errors.Is(err, leader.ErrPermanent) || !strings.Contains(err.Error(), "fix the password") {
			t.Fatalf("Run = %v; want the store's error, wrapping ErrPermanent", err)
		}
		if n := store.count("acquire"); n != 1 {
			t.Errorf("Run made %d attempts; want 1", n)
		}
		t.Logf("Run returned after %v: %v", time.Since(start), err)
	})

	t.Run("before any contact Run returns a permanent error at once, also when enlisting as a candidate succeeds", func(t *testing.T) {
		t.Parallel()
		for range 5 { // the enlistment must never race the first attempt
			mem := leadertest.NewMemStore()
			fs := newFaultStore(mem)
			fs.set(func(f *faultStore) { f.failWith = errMisconfigured })
			cfg := testConfig("perm-transfer", "a")
			cfg.TTL, cfg.RetryInterval = 30*time.Second, 10*time.Second
			e, err := leader.New(transferFaultStore{fs, mem}, cfg)
			if err != nil {
				t.Fatal(err)
			}
			err = runUntilReturns(t, e, 5*time.Second)
			if !errors.Is(err, leader.ErrPermanent) {
				t.Fatalf("Run = %v; want the store's error, wrapping ErrPermanent", err)
			}
		}
	})

	t.Run("before any contact other errors are retried", func(t *testing.T) {
		t.Parallel()
		store := newFaultStore(leadertest.NewMemStore())
		store.set(func(f *faultStore) { f.partitioned = true })
		cfg := testConfig("perm", "a")
		cfg.RetryInterval = 20 * time.Millisecond
		e, err := leader.New(store, cfg)
		if err != nil {
			t.Fatal(err)
		}
		stop := runElector(t, e)
		eventually(t, 10*time.Second, "three attempts", func() bool { return store.count("acquire") >= 3 })
		store.set(func(f *faultStore) { f.partitioned = false })
		eventually(t, 10*time.Second, "leadership", e.IsLeader)
		stop()
	})

	t.Run("after contact a permanent error is shown and retried until mended", func(t *testing.T) {
		t.Parallel()
		store := newFaultStore(leadertest.NewMemStore())
		logs := new(electortest.LogBuffer)
		cfg := testConfig("perm", "a")
		cfg.RetryInterval = 20 * time.Millisecond
		cfg.Logger = slog.New(slog.NewTextHandler(logs, nil))
		e, err := leader.New(store, cfg)
		if err != nil {
			t.Fatal(err)
		}
		stop := runElector(t, e)
		eventually(t, 10*time.Second, "leadership", e.IsLeader)
		store.set(func(f *faultStore) { f.failWith = errMisconfigured })
		eventually(t, 10*time.Second, "the leader to step down", func() bool { return !e.IsLeader() })
		eventually(t, 10*time.Second, "Status.Problem", func() bool { return e.Status().Problem == errMisconfigured.Error() })
		eventually(t, 10*time.Second, "a follower's failed attempt logged at ERROR", func() bool {
			return strings.Contains(logs.String(), `level=ERROR msg="acquire failed"`)
		})
		attempts := store.count("acquire")
		eventually(t, 10*time.Second, "another attempt", func() bool { return store.count("acquire") > attempts })
		store.set(func(f *faultStore) { f.failWith = nil })
		eventually(t, 20*time.Second, "leadership again", e.IsLeader)
		if p := e.Status().Problem; p != "" {
			t.Errorf("Status.Problem = %q after a call succeeded; want none", p)
		}
		stop()
	})

	t.Run("a store read-only for a TTL before any contact makes Run return", func(t *testing.T) {
		t.Parallel()
		store := newFaultStore(leadertest.NewMemStore())
		store.set(func(f *faultStore) { f.failWith = fmt.Errorf("standby: %w", leader.ErrReadOnly) })
		cfg := testConfig("perm", "a")
		cfg.RetryInterval = 50 * time.Millisecond
		e, err := leader.New(store, cfg)
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		err = runUntilReturns(t, e, 20*time.Second)
		if !errors.Is(err, leader.ErrPermanent) || !errors.Is(err, leader.ErrReadOnly) || !strings.Contains(err.Error(), "writable primary") {
			t.Fatalf("Run = %v; want an error wrapping ErrPermanent and ErrReadOnly that says to reach a writable primary", err)
		}
		if took := time.Since(start); took < cfg.TTL {
			t.Errorf("Run gave up after %v, before a TTL (%v) of refusals", took, cfg.TTL)
		}
	})

	t.Run("a store read-only for less than a TTL at start is waited for", func(t *testing.T) {
		t.Parallel()
		store := newFaultStore(leadertest.NewMemStore())
		store.set(func(f *faultStore) { f.failWith = fmt.Errorf("standby: %w", leader.ErrReadOnly) })
		cfg := testConfig("perm", "a")
		cfg.TTL = 5 * time.Second
		cfg.RetryInterval = 20 * time.Millisecond
		e, err := leader.New(store, cfg)
		if err != nil {
			t.Fatal(err)
		}
		stop := runElector(t, e)
		eventually(t, 10*time.Second, "three attempts", func() bool { return store.count("acquire") >= 3 })
		store.set(func(f *faultStore) { f.failWith = nil })
		eventually(t, 10*time.Second, "leadership", e.IsLeader)
		stop()
	})
}

// TestStepDownLogNamesTheCause checks that a leader whose renewals are
// never answered, so that none fails, logs why it stepped down: no log line of an error says
// error=<nil>, and none says the work stopped late when it stopped in time.
func TestStepDownLogNamesTheCause(t *testing.T) {
	t.Parallel()
	store := newFaultStore(leadertest.NewMemStore())
	logs := new(electortest.LogBuffer)
	cfg := testConfig("hung", "a")
	// A StopGrace (TTL/5) of 1 s: a busy machine that runs OnDemoted
	// later than that after the stop point would log, rightly, that the
	// work stopped late (200 ms, with a TTL of 1 s, was at times too short).
	cfg.TTL = 5 * time.Second
	cfg.Logger = slog.New(slog.NewTextHandler(logs, nil))
	e, err := leader.New(store, cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop := runElector(t, e)
	eventually(t, 10*time.Second, "leadership", e.IsLeader)
	stuck := make(chan struct{})
	store.set(func(f *faultStore) { f.stuckRenew = stuck }) // never answered, whatever its context
	eventually(t, 10*time.Second, "the leader to step down", func() bool { return !e.IsLeader() })
	// The renewal in flight stays stuck past the local deadline (a
	// StopGrace, 1 s, after the step-down), which the release waits
	// for; the work itself stopped at the step-down, in time.
	time.Sleep(cfg.TTL / 2)
	close(stuck)
	stop()
	out := logs.String()
	if strings.Contains(out, "error=<nil>") {
		t.Errorf("a log line says error=<nil>:\n%s", out)
	}
	if strings.Contains(out, "leader work stopped after the local deadline") {
		t.Errorf("the log says the work stopped late, but OnDemoted returned at the stop point:\n%s", out)
	}
	if !strings.Contains(out, "could not renew before the local deadline") {
		t.Errorf("no step-down line in the log:\n%s", out)
	}
}

// TestRefusedRenewalsBackOff checks a leader whose store grants but
// refuses renewals with a permanent error (a role missing one privilege,
// say): it steps down at the first refusal, with reason "error", and
// campaigns again after a backoff that doubles, instead of stepping up and
// down at every RetryInterval.
func TestRefusedRenewalsBackOff(t *testing.T) {
	t.Parallel()
	store := newFaultStore(leadertest.NewMemStore())
	metrics := &recordingMetrics{}
	cfg := testConfig("refused", "a")
	cfg.TTL = 30 * time.Second
	cfg.RenewInterval = 20 * time.Millisecond
	cfg.RetryInterval = 20 * time.Millisecond
	cfg.Metrics = metrics
	e, err := leader.New(store, cfg)
	if err != nil {
		t.Fatal(err)
	}
	store.set(func(f *faultStore) { f.renewErr = errMisconfigured })
	stop := runElector(t, e)
	eventually(t, 20*time.Second, "five tenures", func() bool {
		store.mu.Lock()
		defer store.mu.Unlock()
		return len(store.grants) >= 5
	})
	stop()
	store.mu.Lock()
	grants := append([]time.Time(nil), store.grants...)
	store.mu.Unlock()
	// Each gap is a renewal's wait plus the backoff, which doubles from
	// RetryInterval after each refused tenure: the fourth gap holds a
	// backoff of 8 RetryIntervals (160 ms) at least, where without the
	// doubling it would be about 2 (40 ms). A busy machine only lengthens
	// gaps, so the bound holds however loaded it is (a ratio of the first
	// gap to the last, its first form, did not).
	if last := grants[4].Sub(grants[3]); last < 8*cfg.RetryInterval {
		t.Errorf("gaps between tenures %v then %v: want the fourth at least %v, the wait doubled after each refused tenure", grants[1].Sub(grants[0]), last, 8*cfg.RetryInterval)
	}
	losses := metrics.losses()
	for _, r := range losses[:len(losses)-1] { // the last tenure may end with the stop
		if r != leader.LossError {
			t.Errorf("a tenure ended for reason %q; want %q at the first refused renewal", r, leader.LossError)
		}
	}
}
