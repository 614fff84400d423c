package filelock

import (
	"context"
	"encoding/binary"
	"maps"
	"syscall"
	"testing"
	"time"

	"github.com/leaderelect/leader"
)

// inotifyEvent encodes one struct inotify_event as the kernel does, its
// name NUL-padded to a multiple of 16 bytes.
func inotifyEvent(wd int32, mask uint32, name string) []byte {
	n := 0
	if name != "" {
		n = (len(name) + 1 + 15) / 16 * 16
	}
	b := make([]byte, syscall.SizeofInotifyEvent+n)
	binary.NativeEndian.PutUint32(b[0:], uint32(wd))
	binary.NativeEndian.PutUint32(b[4:], mask)
	binary.NativeEndian.PutUint32(b[12:], uint32(n))
	copy(b[syscall.SizeofInotifyEvent:], name)
	return b
}

func TestNotifierParse(t *testing.T) {
	t.Parallel()
	var b []byte
	for _, ev := range []struct {
		mask uint32
		name string
	}{
		{syscall.IN_MOVED_TO, "job.state"},
		{syscall.IN_CLOSE_WRITE, "job.state.lock"}, // every call: no news
		{syscall.IN_CLOSE_WRITE, "job.state.tmp"},  // before the rename: no news
		{syscall.IN_CLOSE_WRITE, "other.leader.lock"},
		{syscall.IN_CREATE, "other.leader.lock"}, // created, not closed: no news
		{syscall.IN_CREATE, "new.state"},
		{syscall.IN_MOVED_TO | syscall.IN_ISDIR, "dir.state"},
		{syscall.IN_CLOSE_WRITE, "unrelated"},
		{syscall.IN_CLOSE_WRITE, ".state"},
		{syscall.IN_CLOSE_WRITE, "%4Aob.leader.lock"},
	} {
		b = append(b, inotifyEvent(1, ev.mask, ev.name)...)
	}
	n := newNotifier(nil)
	n.parse(b)
	hints, lost, failed := n.take()
	want := map[string]hint{"job": hintState, "other": hintLock, "new": hintState, "%4Aob": hintLock}
	if !maps.Equal(hints, want) || lost || failed {
		t.Errorf("parse: hints %v lost %v failed %v; want %v, false, false", hints, lost, failed, want)
	}
	select {
	case <-n.ready:
	default:
		t.Error("parse of news did not signal it")
	}

	n.parse(inotifyEvent(-1, syscall.IN_Q_OVERFLOW, ""))
	if _, lost, failed := n.take(); !lost || failed {
		t.Errorf("after an overflow: lost %v failed %v; want true, false", lost, failed)
	}
	if _, lost, _ := n.take(); lost {
		t.Error("take did not forget the overflow")
	}
	n.parse(inotifyEvent(1, syscall.IN_IGNORED, ""))
	if _, _, failed := n.take(); !failed {
		t.Error("after the watch was removed: not failed")
	}
}

// needInotify skips the test if this process cannot have an inotify
// instance now; the Stores would poll.
func needInotify(t *testing.T) {
	t.Helper()
	fd, err := syscall.InotifyInit1(syscall.IN_CLOEXEC)
	if err != nil {
		t.Skipf("inotify unavailable here: %v", err)
	}
	syscall.Close(fd)
}

// waitFor polls cond until it holds or waitTimeout passes.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not %s within 10s", what)
		}
		time.Sleep(time.Millisecond) // poll interval
	}
}

// TestLooksMakeNoEvents: Stores watching a name held by a live holder each
// look once (plus the settling looks) when someone opens and closes the
// name's leader lock, and not again: their own looks, which try that lock,
// must not be events for each other (or themselves), or they would look
// without end.
//
// Not parallel: each Store needs an inotify instance; see
// TestWakeIsEventDriven.
func TestLooksMakeNoEvents(t *testing.T) {
	needInotify(t)
	dir := t.TempDir()
	open := func(opts ...Option) *Store {
		s, err := Open(dir, opts...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		return s
	}
	holder, other := open(), open()
	a, b := open(WithPollInterval(time.Hour)), open(WithPollInterval(time.Hour))
	if _, granted, err := holder.Acquire(t.Context(), "job", leader.Candidate{ID: "h", Token: "h"}, time.Hour); err != nil || !granted {
		t.Fatalf("Acquire: granted %v, %v", granted, err)
	}
	for _, s := range []*Store{a, b} {
		if _, err := s.Watch(t.Context(), "job"); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "looked at the name", func() bool { return a.checks.Load() > 0 && b.checks.Load() > 0 })
	// Let the looks caused by the Watch calls settle: a quiet window, not
	// a wait for an event.
	time.Sleep(100 * time.Millisecond)

	a0, b0 := a.checks.Load(), b.checks.Load()
	if _, err := other.Observe(t.Context(), "job"); err != nil { // opens and closes the leader lock
		t.Fatal(err)
	}
	waitFor(t, "looked again after the leader lock was closed", func() bool { return a.checks.Load() > a0 && b.checks.Load() > b0 })
	time.Sleep(200 * time.Millisecond) // a quiet window
	// One look for the report, the settling looks, and a few retries of
	// looks that found the state lock taken (by the Observe, or by the
	// other watching Store); looks that fed each other would be thousands.
	const most = 10
	da, db := a.checks.Load()-a0, b.checks.Load()-b0
	t.Logf("looks after one close: %d and %d", da, db)
	if da > most || db > most {
		t.Errorf("after one close of the leader lock the watching Stores looked %d and %d times; want at most %d each", da, db, most)
	}
}

// TestPollsWithoutInotify: a Store that cannot use inotify learns of other
// Stores' changes by polling.
func TestPollsWithoutInotify(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	a, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	noNotify := Option(func(o *options) { o.noNotify = true })
	s, err := Open(dir, WithPollInterval(20*time.Millisecond), noNotify)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ch, err := s.Watch(t.Context(), "job")
	if err != nil {
		t.Fatal(err)
	}
	wait := func(what string) {
		t.Helper()
		timer := time.NewTimer(10 * time.Second)
		defer timer.Stop()
		select {
		case <-ch:
		case <-timer.C:
			t.Fatalf("no wake-up within 10s %s", what)
		}
	}
	ctx := context.Background()
	l, granted, err := a.Acquire(ctx, "job", leader.Candidate{ID: "alice", Token: "alice"}, time.Hour)
	if err != nil || !granted {
		t.Fatalf("Acquire: granted %v, %v", granted, err)
	}
	wait("after another Store's grant")
	if err := a.Release(ctx, "job", "alice", l.Term); err != nil {
		t.Fatal(err)
	}
	wait("after another Store's release")
}
