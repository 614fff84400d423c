//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package supervise

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

func startUntil(t *testing.T, script string, grace time.Duration, deadline Deadline) *Child {
	t.Helper()
	c, err := Start(Options{Executable: os.Args[0], Command: []string{"sh", "-c", script}, Grace: grace, Deadline: deadline})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Kill() })
	return c
}

func TestDeadlineStopsTheGroupUnlessExtended(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	pidFile := filepath.Join(dir, "grandchild")
	// Far enough that the command starts first on a loaded machine (300
	// ms was not, under go test -parallel 8).
	at := time.Now().Add(2 * time.Second)
	d, err := DeadlineAt(at)
	if err != nil {
		t.Fatal(err)
	}
	c := startUntil(t, fmt.Sprintf("sleep 100 & echo $! > %s; wait", pidFile), 5*time.Second, d)
	grandchild := readPid(t, pidFile)
	r := c.Result()
	late := time.Since(at)
	if r.Signal != syscall.SIGTERM || !r.DeadlinePassed {
		t.Errorf("result %+v, want killed by SIGTERM for its deadline", r)
	}
	if late < 0 || late > 2*time.Second {
		t.Errorf("the group was gone %v after its deadline", late)
	}
	if exists(grandchild) {
		t.Errorf("grandchild %d still runs", grandchild)
	}
}

func TestExtendKeepsTheCommandRunning(t *testing.T) {
	t.Parallel()
	// Deadlines a second on: far enough that the command starts, and the
	// next extension comes, first on a loaded machine (200 ms was not,
	// under go test -parallel 8).
	const ahead = time.Second
	d, err := DeadlineAt(time.Now().Add(ahead))
	if err != nil {
		t.Fatal(err)
	}
	c := startUntil(t, "sleep 100", time.Second, d)
	// Keep moving the deadline on for a while: the command keeps running.
	end := time.Now().Add(2 * ahead)
	for time.Now().Before(end) {
		d, err := DeadlineAt(time.Now().Add(ahead))
		if err != nil {
			t.Fatal(err)
		}
		c.Extend(d)
		select {
		case <-c.Done():
			t.Fatalf("stopped although extended: %+v", c.Result())
		case <-time.After(50 * time.Millisecond):
		}
	}
	// An earlier deadline, or one already passed (a frozen leader writing
	// late), does not bring it forward; then it passes.
	past, _ := DeadlineAt(time.Now().Add(-time.Hour))
	c.Extend(past)
	began := time.Now()
	r := c.Result()
	if took := time.Since(began); !r.DeadlinePassed || took < ahead/2 || took > ahead+2*time.Second {
		t.Errorf("result %+v after %v, want stopped for the deadline, about %v on: neither brought forward by the earlier deadline nor late", r, took, ahead)
	}
}

func TestACommandPastItsDeadlineDoesNotStart(t *testing.T) {
	t.Parallel()
	ran := filepath.Join(t.TempDir(), "ran")
	d, err := DeadlineAt(time.Now().Add(-time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	_, err = Start(Options{Executable: os.Args[0], Command: []string{"touch", ran}, Grace: time.Second, Deadline: d})
	var se *StartError
	if !errors.As(err, &se) || !se.Result.DeadlinePassed || !errors.Is(err, ErrDeadlinePassed) {
		t.Fatalf("err %v, want a StartError for a passed deadline", err)
	}
	if _, err := os.Stat(ran); err == nil {
		t.Error("the command ran")
	}
	if _, err := Start(Options{Executable: os.Args[0], Command: []string{"true"}}); err == nil {
		t.Error("started a command without a deadline")
	}
}
