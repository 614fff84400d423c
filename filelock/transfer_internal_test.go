package filelock

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/leaderelect/leader"
)

// previousState is the state file as builds before transfers read and
// wrote it: what an older binary still running on the host makes of it.
type previousState struct {
	Version      int       `json:"version"`
	Name         string    `json:"name"`
	Term         uint64    `json:"term"`
	HolderID     string    `json:"holder_id,omitempty"`
	Token        string    `json:"token,omitempty"`
	PID          int       `json:"pid,omitempty"`
	LeaderLock   bool      `json:"leader_lock,omitempty"`
	AcquiredAt   time.Time `json:"acquired_at,omitzero"`
	RenewedAt    time.Time `json:"renewed_at,omitzero"`
	ExpiresAt    time.Time `json:"expires_at,omitzero"`
	Clock        string    `json:"clock,omitempty"`
	BootID       string    `json:"boot_id,omitempty"`
	RenewedClock int64     `json:"renewed_clock_ns,omitempty"`
	ExpiresClock int64     `json:"expires_clock_ns,omitempty"`
}

// readPrevious reads name's state file as an older binary does.
func readPrevious(t *testing.T, s *Store, name string) previousState {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(s.dir, encodeName(name)) + stateSuffix)
	if err != nil {
		t.Fatal(err)
	}
	var st previousState
	if err := json.Unmarshal(b, &st); err != nil {
		t.Fatalf("an older binary cannot read the state: %v\n%s", err, b)
	}
	if st.Version > stateVersion {
		t.Fatalf("an older binary refuses the state's version %d", st.Version)
	}
	return st
}

// writePrevious writes name's state file as an older binary does.
func writePrevious(t *testing.T, s *Store, name string, st previousState) {
	t.Helper()
	base := filepath.Join(s.dir, encodeName(name))
	if err := replaceFile(base+stateSuffix, base+tempSuffix, st, true); err != nil {
		t.Fatal(err)
	}
}

// openTemp opens a Store on a directory of its own, closed when the test
// ends.
func openTemp(t *testing.T) *Store {
	t.Helper()
	s, err := Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// stateText returns name's state file.
func stateText(t *testing.T, s *Store, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(s.dir, encodeName(name)) + stateSuffix)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestStateFileRecordsTransfers(t *testing.T) {
	t.Parallel()
	s, ctx := openTemp(t), context.Background()
	alice := leader.Candidate{ID: "alice", Token: "alice-token", Priority: 3}
	bob := leader.Candidate{ID: "bob", Token: "bob-token"}
	l, _, err := s.Acquire(ctx, "job", alice, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.RequestTransfer(ctx, "job", leader.TransferRequest{To: "bob", Reason: leader.GrantTransfer}, time.Minute); err != nil {
		t.Fatal(err)
	}
	text := stateText(t, s, "job")
	for _, want := range []string{`"version": 1`, `"priority": 3`, `"transfer_request": {`, `"to": "bob"`, `"until_clock_ns"`} {
		if !strings.Contains(text, want) {
			t.Errorf("state with a pending request lacks %s:\n%s", want, text)
		}
	}
	if err := s.ReleaseTo(ctx, "job", alice.Token, l.Term, bob, leader.GrantTransfer, time.Minute); err != nil {
		t.Fatal(err)
	}
	text = stateText(t, s, "job")
	for _, want := range []string{`"version": 1`, `"reserved": {`, `"id": "bob"`, `"token": "bob-token"`, `"reason": "transfer"`} {
		if !strings.Contains(text, want) {
			t.Errorf("state reserved for bob lacks %s:\n%s", want, text)
		}
	}
	if strings.Contains(text, "transfer_request") {
		t.Errorf("a handover left the request in the state:\n%s", text)
	}
	if old := readPrevious(t, s, "job"); old.Token != "" || old.Term != l.Term {
		t.Errorf("an older binary reads a reserved state as held by %q, term %d; want free, term %d", old.Token, old.Term, l.Term)
	}
}

// TestStateFromThePreviousFormat: state files that builds before transfers
// wrote are read as they were: reason and priority unknown (zero), a
// release told apart from an expiry.
func TestStateFromThePreviousFormat(t *testing.T) {
	t.Parallel()
	s, ctx := openTemp(t), context.Background()
	now, err := monotonicNow()
	if err != nil {
		t.Fatal(err)
	}
	writePrevious(t, s, "held", previousState{
		Version: 1, Name: "held", Term: 4, HolderID: "old", Token: "old-token", PID: 1,
		Clock: clockName, BootID: s.boot, RenewedClock: now, ExpiresClock: now + int64(time.Hour),
	})
	l, granted, err := s.Acquire(ctx, "held", leader.Candidate{ID: "me", Token: "me-token", Priority: 1}, time.Minute)
	if err != nil || granted || l.HolderID != "old" || l.Term != 4 || l.Priority != 0 || l.Reason != leader.GrantFirst || l.Transfer.Pending() {
		t.Fatalf("Acquire of a lease an older binary holds: granted %v, %+v, %v; want refused, held by old, term 4, priority 0, no reason or request", granted, l, err)
	}
	writePrevious(t, s, "released", previousState{Version: 1, Name: "released", Term: 7})
	l, granted, err = s.Acquire(ctx, "released", leader.Candidate{ID: "me", Token: "me-token"}, time.Minute)
	if err != nil || !granted || l.Term != 8 || l.Reason != leader.GrantRelease {
		t.Fatalf("Acquire of a lease an older binary released: granted %v, %+v, %v; want term 8, reason %q", granted, l, err, leader.GrantRelease)
	}
	writePrevious(t, s, "expired", previousState{
		Version: 1, Name: "expired", Term: 2, HolderID: "old", Token: "old-token",
		Clock: clockName, BootID: s.boot, RenewedClock: now - int64(time.Minute), ExpiresClock: now - 1,
	})
	l, granted, err = s.Acquire(ctx, "expired", leader.Candidate{ID: "me", Token: "me-token"}, time.Minute)
	if err != nil || !granted || l.Term != 3 || l.Reason != leader.GrantExpiry {
		t.Fatalf("Acquire of a lease that ran out under an older binary: granted %v, %+v, %v; want term 3, reason %q", granted, l, err, leader.GrantExpiry)
	}
}

// TestOlderBinaryOverAReservation: an older binary ignores a reservation
// and may take the lease out of turn, but the state still names one
// holder: the successor is then refused, not granted too.
func TestOlderBinaryOverAReservation(t *testing.T) {
	t.Parallel()
	s, ctx := openTemp(t), context.Background()
	alice := leader.Candidate{ID: "alice", Token: "alice-token"}
	bob := leader.Candidate{ID: "bob", Token: "bob-token"}
	l, _, err := s.Acquire(ctx, "job", alice, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.ReleaseTo(ctx, "job", alice.Token, l.Term, bob, leader.GrantTransfer, time.Minute); err != nil {
		t.Fatal(err)
	}

	// The older binary's grant to carol: it reads the state as free and
	// writes its own, without the fields it does not know.
	now, err := monotonicNow()
	if err != nil {
		t.Fatal(err)
	}
	old := readPrevious(t, s, "job")
	old.Term++
	old.HolderID, old.Token, old.PID = "carol", "carol-token", 1
	old.Clock, old.BootID, old.RenewedClock, old.ExpiresClock = clockName, s.boot, now, now+int64(time.Hour)
	writePrevious(t, s, "job", old)

	got, granted, err := s.Acquire(ctx, "job", bob, time.Minute)
	if err != nil || granted || got.HolderID != "carol" || got.Term != l.Term+1 || got.Successor != "" {
		t.Fatalf("the successor's Acquire after an older binary took the lease: granted %v, %+v, %v; want refused, held by carol, term %d", granted, got, err, l.Term+1)
	}
}

// TestTornCandidatesFile: a candidates file that a crash left torn lists
// nobody, and the next enlisting replaces it.
func TestTornCandidatesFile(t *testing.T) {
	t.Parallel()
	s, ctx := openTemp(t), context.Background()
	path := filepath.Join(s.dir, "job"+candidatesSuffix)
	if err := os.WriteFile(path, []byte(`{"version": 1, "na`), 0o600); err != nil {
		t.Fatal(err)
	}
	if cands, err := s.Candidates(ctx, "job"); err != nil || len(cands) != 0 {
		t.Fatalf("Candidates from a torn file = %v, %v; want none, nil", cands, err)
	}
	if err := s.Enlist(ctx, "job", leader.Candidate{ID: "bob", Token: "bob-token", Priority: 2}, time.Minute); err != nil {
		t.Fatal(err)
	}
	cands, err := s.Candidates(ctx, "job")
	if err != nil || len(cands) != 1 || cands[0] != (leader.Candidate{ID: "bob", Token: "bob-token", Priority: 2}) {
		t.Fatalf("Candidates after enlisting over a torn file = %v, %v; want bob", cands, err)
	}
}
