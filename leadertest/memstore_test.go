package leadertest

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/leaderelect/leader"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func TestMemStore(t *testing.T) {
	t.Parallel()
	TestStore(t, func(*testing.T) leader.Store { return NewMemStore() })
}
