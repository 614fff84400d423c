package leadertest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/leaderelect/leader"
)

func testCancelledContext(t *testing.T, s leader.Store) {
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	checkContextHonoured(t, s, ctx, context.Canceled)
}

func testExpiredContext(t *testing.T, s leader.Store) {
	ctx, cancel := context.WithDeadline(t.Context(), time.Now().Add(-time.Second))
	defer cancel()
	checkContextHonoured(t, s, ctx, context.DeadlineExceeded)
}

// checkContextHonoured calls every method with ended on a held name, where
// each call would succeed if it ignored its context.
func checkContextHonoured(t *testing.T, s leader.Store, ended context.Context, want error) {
	t.Helper()
	name := newName()
	alice := newCandidate("alice")
	held := mustGrant(t, s, name, alice, longTTL)
	calls := []struct {
		method string
		call   func() error
	}{
		{"Acquire", func() error { _, _, err := s.Acquire(ended, name, alice, longTTL); return err }},
		{"Renew", func() error { _, err := s.Renew(ended, name, alice.Token, held.Term, longTTL); return err }},
		{"Release", func() error { return s.Release(ended, name, alice.Token, held.Term) }},
		{"Observe", func() error { _, err := s.Observe(ended, name); return err }},
		{"Watch", func() error { _, err := s.Watch(ended, name); return err }},
	}
	for _, c := range calls {
		done := make(chan error, 1)
		go func() { done <- c.call() }()
		select {
		case err := <-done:
			if !errors.Is(err, want) {
				t.Errorf("%s with an ended context returned %v; want an error wrapping %v", c.method, err, want)
			}
		case <-time.After(waitTimeout):
			t.Errorf("%s with an ended context has not returned after %v", c.method, waitTimeout)
		}
	}
}
