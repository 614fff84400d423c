package supervise

import (
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// The supervisor ignores job-control and terminal signals (and the leader
// process ignores the job-control ones), but the command gets them with
// their default action, as it would from a shell.
func TestCommandGetsDefaultSignalDispositions(t *testing.T) {
	t.Parallel()
	out := filepath.Join(t.TempDir(), "sigign")
	// This test's process stands in for the leader process: it ignores
	// what "leader run" ignores, in a copy of itself started to do so.
	cmd := exec.Command(os.Args[0], "-test.run=^TestCommandGetsDefaultSignalDispositions$")
	cmd.Env = append(os.Environ(), "SUPERVISE_TEST_IGNORING=1", "SUPERVISE_TEST_OUT="+out)
	if os.Getenv("SUPERVISE_TEST_IGNORING") == "" {
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%v\n%s", err, b)
		}
		b, err := os.ReadFile(out)
		if err != nil {
			t.Fatal(err)
		}
		mask, err := strconv.ParseUint(strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(string(b)), "SigIgn:")), 16, 64)
		if err != nil {
			t.Fatalf("SigIgn line %q: %v", b, err)
		}
		// A signal this test process was started with ignored (nohup
		// ignores SIGHUP) is the user's choice and is passed on, as exec
		// passes on every ignored signal: only what the leader process
		// ignores itself must be reset.
		inherited := sigIgn(t, "/proc/self/status")
		for _, sig := range []syscall.Signal{syscall.SIGTSTP, syscall.SIGTTIN, syscall.SIGTTOU, syscall.SIGINT, syscall.SIGHUP, syscall.SIGQUIT, syscall.SIGPIPE} {
			bit := uint64(1) << (uint(sig) - 1)
			if mask&bit != 0 && inherited&bit == 0 {
				t.Errorf("the command has %v ignored (SigIgn %x)", sig, mask)
			}
		}
		return
	}
	ignoreJobControl()
	c := start(t, `grep SigIgn /proc/$$/status > "$SUPERVISE_TEST_OUT"`, 0)
	if r := c.Result(); !r.Success() {
		t.Fatalf("command: %v", r)
	}
}

func ignoreJobControl() {
	signal.Ignore(syscall.SIGTSTP, syscall.SIGTTIN, syscall.SIGTTOU)
}

// sigIgn returns the SigIgn mask in the /proc status file at path.
func sigIgn(t *testing.T, path string) uint64 {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "SigIgn:"); ok {
			mask, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			if err != nil {
				t.Fatalf("%s: SigIgn line %q: %v", path, line, err)
			}
			return mask
		}
	}
	t.Fatalf("%s has no SigIgn line", path)
	return 0
}
