package filelock_test

import (
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/filelock"
)

// TestWakeIsEventDriven: with the poll interval an hour, a watcher in this
// process still wakes within a bound when another process is granted the
// lease, releases it, or is killed while holding it. Only the kernel's
// reports on the directory (inotify) can explain that.
//
// Not parallel: the Store needs an inotify instance of its own, of which the
// user may have few (fs.inotify.max_user_instances); parallel tests might
// hold them all, and the Store would then poll, quietly.
func TestWakeIsEventDriven(t *testing.T) {
	if fd, err := syscall.InotifyInit1(syscall.IN_CLOEXEC); err != nil {
		t.Skipf("inotify unavailable here, so the Store polls: %v", err)
	} else {
		syscall.Close(fd)
	}
	const (
		within = waitTimeout // a poll would take an hour
		rounds = 5
	)
	dir := t.TempDir()
	s := open(t, dir, filelock.WithPollInterval(time.Hour))
	ch, err := s.Watch(t.Context(), "job")
	if err != nil {
		t.Fatal(err)
	}

	// untilLease waits for wake-ups, from since, until Observe reports a
	// lease that ok accepts, and returns how long after since the last
	// wake-up came. A spurious wake-up, or a pending one from earlier, does
	// not end the wait early.
	untilLease := func(since time.Time, what string, ok func(leader.Lease) bool) time.Duration {
		t.Helper()
		deadline := since.Add(within)
		for {
			timer := time.NewTimer(time.Until(deadline))
			select {
			case _, open := <-ch:
				timer.Stop()
				if !open {
					t.Fatalf("watch channel closed while waiting for a wake-up %s", what)
				}
			case <-timer.C:
				t.Fatalf("no wake-up within %v %s (lease now %+v)", within, what, mustObserve(t, s, "job"))
			}
			woke := time.Since(since)
			if ok(mustObserve(t, s, "job")) {
				return woke
			}
		}
	}
	heldBy := func(id string) func(leader.Lease) bool {
		return func(l leader.Lease) bool { return l.Held() && l.HolderID == id }
	}
	free := func(l leader.Lease) bool { return !l.Held() }

	var releases, kills []time.Duration
	for range rounds {
		// startHolder returns once the child says it was granted the
		// lease, so the wake-up may have come already; it is not timed.
		child := startHolder(t, dir, "job", "child", time.Hour)
		untilLease(time.Now(), "after another process was granted the lease", heldBy("child"))

		released := time.Now()
		child.release(t)
		releases = append(releases, untilLease(released, "after another process released the lease", free))
		child.kill()

		child = startHolder(t, dir, "job", "victim", time.Hour)
		untilLease(time.Now(), "after another process was granted the lease", heldBy("victim"))
		killed := time.Now()
		if err := child.cmd.Process.Kill(); err != nil {
			t.Fatal(err)
		}
		kills = append(kills, untilLease(killed, "after the holder process was killed", free))
		child.kill() // reap it
	}
	t.Logf("wake-up (to a lease showing the change) over %d rounds, min / median / max:", rounds)
	t.Logf("  release by another process: %v / %v / %v after asking the child", spread(releases)...)
	t.Logf("  SIGKILL of the holder process: %v / %v / %v after the signal", spread(kills)...)
}

// spread returns the minimum, median and maximum of ds, rounded.
func spread(ds []time.Duration) []any {
	ds = slices.Clone(ds)
	slices.Sort(ds)
	r := func(d time.Duration) any { return d.Round(10 * time.Microsecond) }
	return []any{r(ds[0]), r(ds[len(ds)/2]), r(ds[len(ds)-1])}
}

// TestHandoverBetweenProcessesIsEventDriven: a follower Elector whose Store
// polls once an hour leads soon after the leader process releases its lease,
// well before the lease's expiry.
func TestHandoverBetweenProcessesIsEventDriven(t *testing.T) {
	if fd, err := syscall.InotifyInit1(syscall.IN_CLOEXEC); err != nil {
		t.Skipf("inotify unavailable here, so the Store polls: %v", err)
	} else {
		syscall.Close(fd)
	}
	dir := t.TempDir()
	const ttl = time.Hour
	child := startHolder(t, dir, "job", "child", ttl)
	s := open(t, dir, filelock.WithPollInterval(time.Hour))
	_, elected := followChild(t, s, ttl)

	released := time.Now()
	child.release(t)
	timer := time.NewTimer(waitTimeout) // a poll, or the expiry, would take an hour
	defer timer.Stop()
	select {
	case term := <-elected:
		if term != child.term+1 {
			t.Errorf("elected with term %d; want %d", term, child.term+1)
		}
		t.Logf("elector led %v after asking the leader process to release (poll interval 1h, TTL %v)", time.Since(released), ttl)
	case <-timer.C:
		t.Fatalf("elector not elected within %v of the leader process's release (poll interval 1h, TTL %v)", waitTimeout, ttl)
	}
}
