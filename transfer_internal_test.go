package leader

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"
)

// scriptedStore is a Store whose Observe reports the leases of script in
// turn, and the last one from then on. Its other methods are not called
// (they would panic on the nil Store).
type scriptedStore struct {
	Store
	mu     sync.Mutex
	script []Lease
	calls  int
}

func (s *scriptedStore) Observe(ctx context.Context, name string) (Lease, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	l := s.script[min(s.calls, len(s.script)-1)]
	s.calls++
	return l, ctx.Err()
}

// A store may record a grant before its successor holds it: the advisory
// strategy's row shows the new term as the staged release commits, and the
// successor's session takes the lock a moment later. awaitSuccessor takes
// that for a grant in progress, not for one lost again.
func TestAwaitSuccessorWaitsForAGrantInProgress(t *testing.T) {
	granted := Lease{Name: "n", Term: 2} // recorded, not yet held
	held := Lease{Name: "n", Term: 2, HolderID: "b", Remaining: time.Second}

	t.Run("a new term seen unheld is returned once its successor holds it", func(t *testing.T) {
		for _, requested := range []bool{true, false} {
			s := &scriptedStore{script: []Lease{granted, granted, granted, held}}
			l, err := awaitSuccessor(t.Context(), s, nil, "n", 1, "b", requested)
			if err != nil || l.HolderID != "b" || l.Term != 2 {
				t.Fatalf("requested %v: awaitSuccessor = %+v, %v; want the lease held by b with term 2", requested, l, err)
			}
		}
	})
	t.Run("a grant taken by another candidate than the one named fails", func(t *testing.T) {
		other := held
		other.HolderID = "c"
		s := &scriptedStore{script: []Lease{granted, other}}
		l, err := awaitSuccessor(t.Context(), s, nil, "n", 1, "b", true)
		if !errors.Is(err, ErrTransferNotTaken) || l.HolderID != "c" {
			t.Fatalf("awaitSuccessor = %+v, %v; want the lease held by c and ErrTransferNotTaken", l, err)
		}
	})
	t.Run("a later term that stays unheld fails the wait after grantSettle", func(t *testing.T) {
		s := &scriptedStore{script: []Lease{granted}}
		start := time.Now()
		l, err := awaitSuccessor(t.Context(), s, nil, "n", 1, "b", true)
		if took := time.Since(start); !errors.Is(err, ErrTransferNotTaken) || l.Term != 2 || took < grantSettle {
			t.Fatalf("awaitSuccessor = %+v, %v after %v; want ErrTransferNotTaken after at least %v", l, err, took, grantSettle)
		}
	})
	t.Run("a later term reserved for its successor is waited for beyond grantSettle", func(t *testing.T) {
		// As an advisory staged release leaves the row until the
		// successor's session claims it: unheld, reserved for it.
		reserved := granted
		reserved.Successor, reserved.Reserved = "b", time.Second
		script := make([]Lease, 0, 21)
		for range 20 { // 100 ms apart from the sixth on: about 1.6 s
			script = append(script, reserved)
		}
		s := &scriptedStore{script: append(script, held)}
		start := time.Now()
		l, err := awaitSuccessor(t.Context(), s, nil, "n", 1, "b", true)
		if took := time.Since(start); err != nil || l.HolderID != "b" || took < grantSettle {
			t.Fatalf("awaitSuccessor = %+v, %v after %v; want the lease held by b, after more than %v", l, err, took, grantSettle)
		}
	})
	t.Run("its context ends the wait", func(t *testing.T) {
		s := &scriptedStore{script: []Lease{granted}}
		ctx, cancel := context.WithTimeout(t.Context(), grantSettle/10)
		defer cancel()
		if _, err := awaitSuccessor(ctx, s, nil, "n", 1, "b", true); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("awaitSuccessor = %v; want an error wrapping context.DeadlineExceeded", err)
		}
	})
}
