package leader_test

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/leadertest"
)

// gocronElector is, method for method, the Elector interface of
// github.com/go-co-op/gocron/v2 (distributed.go), declared here so that the
// module need not depend on gocron.
type gocronElector interface {
	IsLeader(context.Context) error
}

var _ gocronElector = leader.GocronElector{}

func TestGocronElector(t *testing.T) {
	t.Parallel()

	store := leadertest.NewMemStore()
	newElector := func(id string) *leader.Elector {
		t.Helper()
		e, err := leader.New(store, leader.Config{
			Name:   "gocron-jobs",
			ID:     id,
			TTL:    time.Second,
			Logger: slog.New(slog.DiscardHandler),
		})
		if err != nil {
			t.Fatalf("New(%q): %v", id, err)
		}
		return e
	}
	a, b := newElector("a"), newElector("b")
	ctx := context.Background()

	t.Run("before Run neither instance leads", func(t *testing.T) {
		for _, e := range []*leader.Elector{a, b} {
			if err := (leader.GocronElector{Elector: e}).IsLeader(ctx); !errors.Is(err, leader.ErrNotLeader) {
				t.Errorf("IsLeader for %s = %v, want ErrNotLeader", e.Config().ID, err)
			}
		}
	})

	runCtx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for _, e := range []*leader.Elector{a, b} {
		wg.Go(func() {
			if err := e.Run(runCtx); err != nil {
				t.Errorf("Run for %s: %v", e.Config().ID, err)
			}
		})
	}
	stopped := false
	stopAll := func() {
		if !stopped {
			stopped = true
			stop()
			wg.Wait()
		}
	}
	defer stopAll()

	deadline := time.Now().Add(5 * time.Second)
	for !a.IsLeader() && !b.IsLeader() {
		if time.Now().After(deadline) {
			t.Fatal("no instance became leader within 5s")
		}
		time.Sleep(5 * time.Millisecond) // polling a condition with a deadline
	}
	leading, following := a, b
	if b.IsLeader() {
		leading, following = b, a
	}

	t.Run("the leader's adapter returns nil", func(t *testing.T) {
		if err := (leader.GocronElector{Elector: leading}).IsLeader(ctx); err != nil {
			t.Errorf("IsLeader for leader %s = %v, want nil", leading.Config().ID, err)
		}
	})
	t.Run("the follower's adapter returns ErrNotLeader", func(t *testing.T) {
		if err := (leader.GocronElector{Elector: following}).IsLeader(ctx); !errors.Is(err, leader.ErrNotLeader) {
			t.Errorf("IsLeader for follower %s = %v, want ErrNotLeader", following.Config().ID, err)
		}
	})

	stopAll()
	t.Run("after Run returns no instance leads", func(t *testing.T) {
		for _, e := range []*leader.Elector{a, b} {
			if err := (leader.GocronElector{Elector: e}).IsLeader(ctx); !errors.Is(err, leader.ErrNotLeader) {
				t.Errorf("IsLeader for %s = %v, want ErrNotLeader", e.Config().ID, err)
			}
		}
	})
}
