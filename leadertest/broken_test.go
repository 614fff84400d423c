package leadertest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/leaderelect/leader"
)

// brokenStoreEnv names the broken store TestBrokenStore runs the suite
// against, in a child process started by TestSuiteCatchesBrokenStores.
const brokenStoreEnv = "LEADERTEST_BROKEN_STORE"

// brokenStore is a store that breaks the contract in one way.
type brokenStore struct {
	kind    string              // how it is broken
	catches string              // the subtest of TestStore that must fail
	new     func() leader.Store // a fresh store
}

// brokenStores are MemStores broken in one way each, and the subtest of
// TestStore that must catch each.
var brokenStores = []brokenStore{
	{"renew ignores the term", "a renewal with a stale term is refused and changes nothing",
		func() leader.Store { return &renewIgnoresTerm{NewMemStore()} }},
	{"a re-grant keeps the term", "the holder acquiring again is a new grant with the next term",
		func() leader.Store { return newRegrantKeepsTerm() }},
	{"release does not wake watchers", "a watcher wakes when the holder releases",
		func() leader.Store { return newReleaseDoesNotWake() }},
	{"acquire takes a held lease", "a second candidate cannot acquire a held lease",
		func() leader.Store { return newAcquireSteals() }},
	{"remaining is longer than the lease", "the remaining time reported to a follower never exceeds the holder's ttl",
		func() leader.Store { return &remainingTooLong{NewMemStore()} }},
	{"calls ignore their context", "every method returns promptly with an error when its context is cancelled",
		func() leader.Store { return &ignoresContext{NewMemStore()} }},
	{"leases run out early", "a follower is never granted the lease before the holder's deadline",
		func() leader.Store { return &expiresEarly{NewMemStore()} }},
	{"renew revives an expired lease", "a renewal after the lease expired is refused and does not revive it",
		func() leader.Store { return &renewRevives{NewMemStore()} }},
	{"release forgets the term", "a release frees the lease and the next grant has the next term",
		func() leader.Store { return &releaseForgetsTerm{NewMemStore()} }},
}

// TestBrokenStore runs the suite against the broken store named by
// $LEADERTEST_BROKEN_STORE ("correct" for an unbroken MemStore), and is
// skipped when it is unset. It is run, and expected to fail, in a child
// process by TestSuiteCatchesBrokenStores.
func TestBrokenStore(t *testing.T) {
	kind := os.Getenv(brokenStoreEnv)
	if kind == "" {
		t.Skip("run by TestSuiteCatchesBrokenStores")
	}
	newStore := func() leader.Store { return NewMemStore() }
	if kind != "correct" {
		i := slices.IndexFunc(brokenStores, func(b brokenStore) bool { return b.kind == kind })
		if i < 0 {
			t.Fatalf("no broken store %q", kind)
		}
		newStore = brokenStores[i].new
	}
	TestStore(t, func(*testing.T) leader.Store { return newStore() })
}

// TestSuiteCatchesBrokenStores is the evidence that TestStore fails for
// stores that break the contract: each broken store must fail the subtest
// written for the clause it breaks, and an unbroken MemStore run the same
// way must pass.
func TestSuiteCatchesBrokenStores(t *testing.T) {
	if os.Getenv(brokenStoreEnv) != "" {
		t.Skip("already in a child process")
	}
	if testing.Short() {
		t.Skip("runs the suite once per broken store")
	}
	t.Parallel()
	failLine := regexp.MustCompile(`--- FAIL: TestBrokenStore/(\S+)`)
	run := func(t *testing.T, kind string) (failed []string, out string, err error) {
		ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestBrokenStore$", "-test.count=1", "-test.timeout=2m", "-test.parallel=64")
		cmd.Env = append(os.Environ(), brokenStoreEnv+"="+kind)
		b, err := cmd.CombinedOutput()
		for _, m := range failLine.FindAllStringSubmatch(string(b), -1) {
			failed = append(failed, strings.ReplaceAll(m[1], "_", " "))
		}
		return failed, string(b), err
	}

	t.Run("an unbroken store passes", func(t *testing.T) {
		t.Parallel()
		failed, out, err := run(t, "correct")
		if err != nil || len(failed) > 0 {
			t.Fatalf("the suite failed an unbroken MemStore (%v):\n%s", err, out)
		}
	})
	for _, b := range brokenStores {
		t.Run(fmt.Sprintf("a store where %s fails", b.kind), func(t *testing.T) {
			t.Parallel()
			failed, out, err := run(t, b.kind)
			var exit *exec.ExitError
			if !errors.As(err, &exit) {
				t.Fatalf("the suite passed a store where %s (%v):\n%s", b.kind, err, out)
			}
			if !slices.Contains(failed, b.catches) {
				t.Fatalf("the suite failed a store where %s, but not %q:\n%s", b.kind, b.catches, out)
			}
			t.Logf("failed %d subtests: %s", len(failed), strings.Join(failed, "; "))
		})
	}
}

// renewIgnoresTerm renews whatever term the lease has now.
type renewIgnoresTerm struct{ *MemStore }

func (s *renewIgnoresTerm) Renew(ctx context.Context, name, token string, _ uint64, ttl time.Duration) (leader.Lease, error) {
	l, err := s.MemStore.Observe(ctx, name)
	if err != nil {
		return leader.Lease{}, err
	}
	return s.MemStore.Renew(ctx, name, token, l.Term, ttl)
}

// regrantKeepsTerm reports the same term when the holder acquires again: it
// hides one term of the MemStore's per re-grant.
type regrantKeepsTerm struct {
	*MemStore
	mu     sync.Mutex
	holder map[string]string // token of the last grant
	offset map[string]uint64 // terms hidden
}

func newRegrantKeepsTerm() *regrantKeepsTerm {
	return &regrantKeepsTerm{MemStore: NewMemStore(), holder: map[string]string{}, offset: map[string]uint64{}}
}

func (s *regrantKeepsTerm) Acquire(ctx context.Context, name string, c leader.Candidate, ttl time.Duration) (leader.Lease, bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	before, err := s.MemStore.Observe(ctx, name)
	if err != nil {
		return leader.Lease{}, false, err
	}
	l, granted, err := s.MemStore.Acquire(ctx, name, c, ttl)
	if granted && before.Held() && s.holder[name] == c.Token {
		s.offset[name]++
	}
	if granted {
		s.holder[name] = c.Token
	}
	l.Term -= s.offset[name]
	return l, granted, err
}

func (s *regrantKeepsTerm) Renew(ctx context.Context, name, token string, term uint64, ttl time.Duration) (leader.Lease, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	l, err := s.MemStore.Renew(ctx, name, token, term+s.offset[name], ttl)
	l.Term -= s.offset[name]
	return l, err
}

func (s *regrantKeepsTerm) Release(ctx context.Context, name, token string, term uint64) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.MemStore.Release(ctx, name, token, term+s.offset[name])
}

func (s *regrantKeepsTerm) Observe(ctx context.Context, name string) (leader.Lease, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	l, err := s.MemStore.Observe(ctx, name)
	l.Term -= s.offset[name]
	return l, err
}

// releaseDoesNotWake wakes its watchers on grants only.
type releaseDoesNotWake struct {
	*MemStore
	mu       sync.Mutex
	watchers map[string][]chan struct{}
}

func newReleaseDoesNotWake() *releaseDoesNotWake {
	return &releaseDoesNotWake{MemStore: NewMemStore(), watchers: map[string][]chan struct{}{}}
}

func (s *releaseDoesNotWake) Acquire(ctx context.Context, name string, c leader.Candidate, ttl time.Duration) (leader.Lease, bool, error) {
	l, granted, err := s.MemStore.Acquire(ctx, name, c, ttl)
	if granted {
		s.mu.Lock()
		for _, ch := range s.watchers[name] {
			select {
			case ch <- struct{}{}:
			default:
			}
		}
		s.mu.Unlock()
	}
	return l, granted, err
}

func (s *releaseDoesNotWake) Watch(ctx context.Context, name string) (<-chan struct{}, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	ch := make(chan struct{}, 1)
	s.mu.Lock()
	s.watchers[name] = append(s.watchers[name], ch)
	s.mu.Unlock()
	context.AfterFunc(ctx, func() {
		s.mu.Lock()
		s.watchers[name] = slices.DeleteFunc(s.watchers[name], func(c chan struct{}) bool { return c == ch })
		s.mu.Unlock()
		close(ch)
	})
	return ch, nil
}

// acquireSteals takes a held lease from its holder.
type acquireSteals struct {
	*MemStore
	mu    sync.Mutex
	grant map[string]leader.Candidate // holder of the last grant
	term  map[string]uint64
}

func newAcquireSteals() *acquireSteals {
	return &acquireSteals{MemStore: NewMemStore(), grant: map[string]leader.Candidate{}, term: map[string]uint64{}}
}

func (s *acquireSteals) Acquire(ctx context.Context, name string, c leader.Candidate, ttl time.Duration) (leader.Lease, bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	l, granted, err := s.MemStore.Acquire(ctx, name, c, ttl)
	if err == nil && !granted {
		_ = s.MemStore.Release(ctx, name, s.grant[name].Token, s.term[name])
		l, granted, err = s.MemStore.Acquire(ctx, name, c, ttl)
	}
	if granted {
		s.grant[name], s.term[name] = c, l.Term
	}
	return l, granted, err
}

// remainingTooLong reports twice the remaining time to observers.
type remainingTooLong struct{ *MemStore }

func (s *remainingTooLong) Observe(ctx context.Context, name string) (leader.Lease, error) {
	l, err := s.MemStore.Observe(ctx, name)
	l.Remaining *= 2
	return l, err
}

// ignoresContext never looks at its callers' contexts.
type ignoresContext struct{ *MemStore }

func (s *ignoresContext) Acquire(ctx context.Context, name string, c leader.Candidate, ttl time.Duration) (leader.Lease, bool, error) {
	return s.MemStore.Acquire(context.WithoutCancel(ctx), name, c, ttl)
}

func (s *ignoresContext) Renew(ctx context.Context, name, token string, term uint64, ttl time.Duration) (leader.Lease, error) {
	return s.MemStore.Renew(context.WithoutCancel(ctx), name, token, term, ttl)
}

func (s *ignoresContext) Release(ctx context.Context, name, token string, term uint64) error {
	return s.MemStore.Release(context.WithoutCancel(ctx), name, token, term)
}

func (s *ignoresContext) Observe(ctx context.Context, name string) (leader.Lease, error) {
	return s.MemStore.Observe(context.WithoutCancel(ctx), name)
}

// expiresEarly grants and renews for half the TTL asked.
type expiresEarly struct{ *MemStore }

func (s *expiresEarly) Acquire(ctx context.Context, name string, c leader.Candidate, ttl time.Duration) (leader.Lease, bool, error) {
	return s.MemStore.Acquire(ctx, name, c, ttl/2)
}

func (s *expiresEarly) Renew(ctx context.Context, name, token string, term uint64, ttl time.Duration) (leader.Lease, error) {
	return s.MemStore.Renew(ctx, name, token, term, ttl/2)
}

// renewRevives renews an expired lease if nobody took it meanwhile.
type renewRevives struct{ *MemStore }

func (s *renewRevives) Renew(ctx context.Context, name, token string, term uint64, ttl time.Duration) (leader.Lease, error) {
	s.mu.Lock()
	if l, ok := s.leases[name]; ok && l.token == token && l.term == term {
		l.expiresAt = time.Now().Add(time.Hour) // revived; the MemStore renews it below
	}
	s.mu.Unlock()
	return s.MemStore.Renew(ctx, name, token, term, ttl)
}

// releaseForgetsTerm deletes the lease on release, so terms start again.
type releaseForgetsTerm struct{ *MemStore }

func (s *releaseForgetsTerm) Release(ctx context.Context, name, token string, term uint64) error {
	if err := s.MemStore.Release(ctx, name, token, term); err != nil {
		return err
	}
	s.mu.Lock()
	delete(s.leases, name)
	s.mu.Unlock()
	return nil
}
