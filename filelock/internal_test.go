package filelock

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/leaderelect/leader"
)

func TestEncodeName(t *testing.T) {
	t.Parallel()
	t.Run("keeps plain names and escapes everything else", func(t *testing.T) {
		t.Parallel()
		for name, want := range map[string]string{
			"nightly-report": "nightly-report",
			"job_2":          "job_2",
			"Jobs/Nightly":   "%4Aobs%2F%4Eightly",
			"a b":            "a%20b",
			"..":             "%2E%2E",
			"x.state":        "x%2Estate",
			"é":              "%C3%A9",
			"%41":            "%2541",
			"~":              "%7E",
		} {
			if got := encodeName(name); got != want {
				t.Errorf("encodeName(%q) = %q; want %q", name, got, want)
			}
		}
	})
	t.Run("hashes empty and long names into distinct, short file names", func(t *testing.T) {
		t.Parallel()
		long := strings.Repeat("ü", 100)
		seen := make(map[string]string)
		for _, name := range []string{"", long, long + "a", long + "b", strings.Repeat("a", 200), strings.Repeat("a", 201)} {
			enc := encodeName(name)
			if len(enc) > maxEncodedLen {
				t.Errorf("encodeName of %d bytes is %d bytes long", len(name), len(enc))
			}
			if strings.ContainsAny(enc, "./") {
				t.Errorf("encodeName(%q) = %q contains '.' or '/'", name, enc)
			}
			if prev, ok := seen[enc]; ok {
				t.Errorf("names %q and %q share the encoding %q", prev, name, enc)
			}
			seen[enc] = name
		}
		if enc := encodeName(strings.Repeat("a", 200)); enc != strings.Repeat("a", 200) {
			t.Errorf("a 200-byte plain name was hashed: %q", enc)
		}
		if enc := encodeName(long); strings.Count(enc, "~") != 1 || strings.Contains(enc[strings.IndexByte(enc, '~')-2:], "%") {
			t.Errorf("hashed encoding %q splits an escape or lacks its '~'", enc)
		}
	})
}

// TestFlockWithinOneProcess checks the property the package relies on for
// several Stores in one process: flock(2) locks belong to open file
// descriptions, so two opens of one file in one process exclude each other.
func TestFlockWithinOneProcess(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "lock")
	a, err := tryLockFile(path)
	if err != nil || a == nil {
		t.Fatalf("first lock: %v, %v", a, err)
	}
	b, err := tryLockFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if b != nil {
		b.Close()
		t.Fatal("a second open file in the same process took the lock held by the first")
	}
	if err := unlockFile(a); err != nil {
		t.Fatal(err)
	}
	b, err = tryLockFile(path)
	if err != nil || b == nil {
		t.Fatalf("lock after unlock: %v, %v", b, err)
	}
	if err := unlockFile(b); err != nil {
		t.Fatal(err)
	}
}

// writeHeld writes a state for name held by "ghost" without the leader
// lock, as a holder granted during another holder's tenure would have, and
// edited by edit.
func writeHeld(t *testing.T, s *Store, name string, edit func(st *state)) {
	t.Helper()
	now, err := monotonicNow()
	if err != nil {
		t.Fatal(err)
	}
	st := state{
		Version: stateVersion, Name: name, Term: 7,
		HolderID: "ghost", Token: "ghost-token", PID: 1,
		AcquiredAt: time.Now(), RenewedAt: time.Now(), ExpiresAt: time.Now().Add(time.Hour),
		Clock: clockName, BootID: s.boot, RenewedClock: now, ExpiresClock: now + int64(time.Hour),
	}
	edit(&st)
	if err := writeState(filepath.Join(s.dir, encodeName(name))+stateSuffix, st, false); err != nil {
		t.Fatal(err)
	}
}

func TestStateJudgement(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name     string
		boot     string // the store's boot ID
		edit     func(st *state)
		wantHeld bool
	}{
		{"an unexpired lease is held", "boot-1", func(st *state) { st.BootID = "boot-1" }, true},
		{"a lease from another boot is free", "boot-2", func(st *state) { st.BootID = "boot-1" }, false},
		{"a lease with an unknown boot is judged by the clock", "", func(st *state) { st.BootID = "boot-1" }, true},
		{"a lease renewed in the clock's future is from another boot", "", func(st *state) {
			st.BootID = ""
			st.RenewedClock += int64(2 * time.Hour)
			st.ExpiresClock += int64(2 * time.Hour)
		}, !clockResetsAtBoot},
		{"a lease judged on another clock is free", "boot-1", func(st *state) { st.BootID, st.Clock = "boot-1", "other" }, false},
		{"an expired lease is free", "boot-1", func(st *state) {
			st.BootID = "boot-1"
			st.ExpiresClock = st.RenewedClock
		}, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			s, err := Open(t.TempDir())
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			s.boot = c.boot
			writeHeld(t, s, "job", c.edit)
			ctx := context.Background()
			l, err := s.Observe(ctx, "job")
			if err != nil {
				t.Fatal(err)
			}
			if l.Held() != c.wantHeld || l.Term != 7 {
				t.Fatalf("Observe: held %v term %d; want held %v term 7", l.Held(), l.Term, c.wantHeld)
			}
			l, granted, err := s.Acquire(ctx, "job", leader.Candidate{ID: "me", Token: "me-token"}, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			if granted == c.wantHeld {
				t.Fatalf("Acquire granted %v; want %v", granted, !c.wantHeld)
			}
			if granted && l.Term != 8 {
				t.Fatalf("Acquire granted term %d; want 8", l.Term)
			}
		})
	}
}

func TestStateFromNewerVersion(t *testing.T) {
	t.Parallel()
	s, err := Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	writeHeld(t, s, "job", func(st *state) { st.Version = stateVersion + 1 })
	if _, err := s.Observe(context.Background(), "job"); err == nil || !strings.Contains(err.Error(), "version") {
		t.Fatalf("Observe of a newer state: %v; want an error about its version", err)
	}
}

func TestStateFileIsReadable(t *testing.T) {
	t.Parallel()
	s, err := Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, _, err := s.Acquire(context.Background(), "job", leader.Candidate{ID: "me", Token: "tok"}, time.Minute); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(s.dir, "job.state"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"holder_id": "me"`, `"term": 1`, `"leader_lock": true`, `"expires_at"`, `"pid"`} {
		if !strings.Contains(string(b), want) {
			t.Errorf("state file lacks %s:\n%s", want, b)
		}
	}
	if _, err := os.Stat(filepath.Join(s.dir, "job"+tempSuffix)); !os.IsNotExist(err) {
		t.Errorf("temporary state file left behind: %v", err)
	}
}
