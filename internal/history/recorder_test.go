package history_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/internal/history"
	"github.com/leaderelect/leader/internal/monotime"
	"github.com/leaderelect/leader/leadertest"
)

func TestMain(m *testing.M) {
	if dir := os.Getenv(childDirEnv); dir != "" {
		os.Exit(recordUntilKilled(dir))
	}
	goleak.VerifyTestMain(m)
}

// childDirEnv names the directory in which the test binary, started again
// as a child by the crash test, records until it is killed.
const childDirEnv = "HISTORY_TEST_CHILD_DIR"

// recordUntilKilled grants, renews and releases leases on a MemStore
// through a RecordingStore as fast as it can, for ever.
func recordUntilKilled(dir string) int {
	rec, err := history.Create(dir, name)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	store := rec.Store(leadertest.NewMemStore(), "child")
	ctx := context.Background()
	c := leader.Candidate{ID: "child", Token: "token"}
	for {
		l, _, err := store.Acquire(ctx, name, c, time.Minute)
		if err == nil {
			_, err = store.Renew(ctx, name, c.Token, l.Term, time.Minute)
		}
		if err == nil {
			err = store.Release(ctx, name, c.Token, l.Term)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
	}
}

func monoNow(t *testing.T) int64 {
	t.Helper()
	now, err := monotime.Now()
	if err != nil {
		t.Fatal(err)
	}
	return now
}

func TestRecordingStore(t *testing.T) {
	t.Parallel()

	t.Run("records grants, renewals and releases with their times", func(t *testing.T) {
		t.Parallel()
		dir := t.TempDir()
		rec, err := history.Create(dir, name)
		if err != nil {
			t.Fatal(err)
		}
		store := rec.Store(leadertest.NewMemStore(), "a")
		other := rec.Store(leadertest.NewMemStore(), "b")
		ctx := t.Context()
		a := leader.Candidate{ID: "a", Token: "ta"}

		before := monoNow(t)
		l, granted, err := store.Acquire(ctx, name, a, time.Minute)
		if err != nil || !granted {
			t.Fatalf("Acquire = %v, %v", granted, err)
		}
		if _, err := store.Renew(ctx, name, a.Token, l.Term, time.Minute); err != nil {
			t.Fatal(err)
		}
		// A refused acquire and a failed renewal record nothing.
		if _, granted, err := store.Acquire(ctx, name, leader.Candidate{ID: "x", Token: "tx"}, time.Minute); err != nil || granted {
			t.Fatalf("a second candidate's Acquire = %v, %v", granted, err)
		}
		if _, err := store.Renew(ctx, name, "tx", l.Term, time.Minute); !errors.Is(err, leader.ErrLeaseLost) {
			t.Fatalf("Renew with a stranger's token: %v", err)
		}
		if err := store.Release(ctx, name, a.Token, l.Term); err != nil {
			t.Fatal(err)
		}
		if _, _, err := other.Acquire(ctx, name, leader.Candidate{ID: "b", Token: "tb"}, time.Minute); err != nil {
			t.Fatal(err)
		}
		after := monoNow(t)
		if err := rec.Close(); err != nil {
			t.Fatal(err)
		}

		evs, err := history.Load(dir)
		if err != nil {
			t.Fatal(err)
		}
		var kinds []string
		for _, e := range evs {
			kinds = append(kinds, fmt.Sprintf("%s %s %d", e.Instance, e.Kind, e.Term))
			if e.At < before || e.At > after || e.Sent > e.At || e.Name != name {
				t.Errorf("event %v: want name %q, sent <= at, within [%d, %d]", e, name, before, after)
			}
			if (e.Kind == history.Granted || e.Kind == history.Renewed) && e.Sent == 0 {
				t.Errorf("event %v has no send time", e)
			}
		}
		want := "a granted 1, a renewed 1, a released 1, b granted 1"
		if got := strings.Join(kinds, ", "); got != want {
			t.Errorf("recorded %s, want %s", got, want)
		}
	})

	t.Run("fails an acquire it cannot record, and releases the grant", func(t *testing.T) {
		t.Parallel()
		rec, err := history.Create(t.TempDir(), name)
		if err != nil {
			t.Fatal(err)
		}
		mem := leadertest.NewMemStore()
		store := rec.Store(mem, "a")
		if err := rec.Close(); err != nil {
			t.Fatal(err)
		}
		if _, granted, err := store.Acquire(t.Context(), name, leader.Candidate{ID: "a", Token: "ta"}, time.Minute); err == nil || granted {
			t.Fatalf("Acquire on a closed recorder = %v, %v; want an error", granted, err)
		}
		if l, err := mem.Observe(t.Context(), name); err != nil || l.Held() {
			t.Fatalf("the unrecorded grant is still held: %+v, %v", l, err)
		}
		if rec.Err() == nil {
			t.Error("Err is nil after a failure to record")
		}
	})
}

func TestLoad(t *testing.T) {
	t.Parallel()

	write := func(t *testing.T, content string) string {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, "1-x.history.jsonl"), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "notes.txt"), []byte("not a history"), 0o644); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	line := `{"at":5,"kind":"elected","name":"job","instance":"a","term":1}` + "\n"

	t.Run("ignores an incomplete last line and other files", func(t *testing.T) {
		t.Parallel()
		evs, err := history.Load(write(t, line+`{"at":9,"kind":"end`))
		if err != nil || len(evs) != 1 || evs[0].At != 5 {
			t.Fatalf("Load = %v, %v; want the one complete line", evs, err)
		}
	})

	t.Run("rejects a line that does not parse", func(t *testing.T) {
		t.Parallel()
		for _, bad := range []string{"garbage\n", `{"at":9,"kind":"crowned"}` + "\n", `{"at":9,"kind":"ended","extra":1}` + "\n"} {
			if evs, err := history.Load(write(t, bad+line)); err == nil {
				t.Errorf("Load(%q) = %v, want an error", bad, evs)
			}
		}
	})
}

// A participant killed with SIGKILL while recording as fast as it can
// leaves only complete lines, and its timestamps are on this process's
// CLOCK_MONOTONIC.
func TestKilledParticipantLeavesCompleteLines(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	before := monoNow(t)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childDirEnv+"="+dir)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	electortest.Eventually(t, 30*time.Second, "the child to record 3000 events", func() bool {
		matches, _ := filepath.Glob(filepath.Join(dir, "*.history.jsonl"))
		if len(matches) != 1 {
			return false
		}
		info, err := os.Stat(matches[0])
		return err == nil && info.Size() > 3000*80
	})
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	err := cmd.Wait()
	if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("the child did not die of SIGKILL: %v", err)
	}
	after := monoNow(t)

	matches, _ := filepath.Glob(filepath.Join(dir, "*.history.jsonl"))
	b, err := os.ReadFile(matches[0])
	if err != nil {
		t.Fatal(err)
	}
	if len(b) == 0 || b[len(b)-1] != '\n' {
		t.Fatalf("the file does not end with a complete line: ...%q", b[max(0, len(b)-100):])
	}
	evs, err := history.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	if lines := strings.Count(string(b), "\n"); len(evs) != lines {
		t.Fatalf("loaded %d events from %d lines", len(evs), lines)
	}
	for _, e := range evs {
		if e.At < before || e.At > after {
			t.Fatalf("event %v not within [%d, %d] on this process's clock", e, before, after)
		}
	}
	rep := history.Check(evs, history.Bounds{OpenEnd: history.EndOpenAt(after)})
	if len(rep.Overlaps) != 0 || len(rep.TermRegressions) != 0 || len(rep.Invalid) != 0 {
		t.Fatalf("the child's history fails:\n%v", rep)
	}
	t.Logf("the child recorded %d events (%d intervals, last open: %v) before SIGKILL",
		len(evs), len(rep.Intervals), rep.Intervals[len(rep.Intervals)-1].Open)
}
