//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package filelock_test

import (
	"bufio"
	"bytes"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// holder is a child process holding a lease.
type holder struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	stderr bytes.Buffer
	term   uint64
}

// startHolder starts a child that acquires name in dir as id for ttl, and
// waits until it has been granted the lease.
func startHolder(t *testing.T, dir, name, id string, ttl time.Duration) *holder {
	t.Helper()
	h := &holder{cmd: exec.Command(os.Args[0], "-test.run=^$")}
	h.cmd.Env = append(os.Environ(),
		helperEnv+"=1", helperDirEnv+"="+dir, helperNameEnv+"="+name, helperIDEnv+"="+id, helperTTLEnv+"="+ttl.String())
	h.cmd.Stderr = &h.stderr
	stdin, err := h.cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	h.stdin = stdin
	stdout, err := h.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := h.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.kill)

	line := make(chan string, 1)
	go func() {
		s, _ := bufio.NewReader(stdout).ReadString('\n')
		line <- s
		_, _ = io.Copy(io.Discard, stdout) // until the child exits
	}()
	timer := time.NewTimer(waitTimeout)
	defer timer.Stop()
	select {
	case s := <-line:
		term, err := strconv.ParseUint(strings.TrimPrefix(strings.TrimSpace(s), "granted "), 10, 64)
		if err != nil {
			h.kill()
			t.Fatalf("child did not acquire the lease: stdout %q, stderr %q", s, h.stderr.String())
		}
		h.term = term
	case <-timer.C:
		h.kill()
		t.Fatalf("child not granted the lease within %v; stderr %q", waitTimeout, h.stderr.String())
	}
	return h
}

// kill sends SIGKILL to the child and waits for it to exit.
func (h *holder) kill() {
	if h.cmd.ProcessState != nil {
		return
	}
	_ = h.cmd.Process.Kill()
	_ = h.stdin.Close()
	_ = h.cmd.Wait()
}

// release tells the child to release the lease. It does not wait for the
// release.
func (h *holder) release(t *testing.T) {
	t.Helper()
	if _, err := io.WriteString(h.stdin, "release\n"); err != nil {
		t.Fatalf("telling the child to release: %v", err)
	}
}

// alive reports whether the child is still running.
func (h *holder) alive() bool {
	return h.cmd.ProcessState == nil && h.cmd.Process.Signal(syscall.Signal(0)) == nil
}

func TestHolderProcessKilled(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	s := open(t, dir)
	ch, err := s.Watch(t.Context(), "job")
	if err != nil {
		t.Fatal(err)
	}

	const ttl = 30 * time.Second
	child := startHolder(t, dir, "job", "child", ttl)
	waitWake(t, ch, waitTimeout, "after another process was granted the lease")

	start := time.Now()
	o := mustObserve(t, s, "job")
	if o.HolderID != "child" || o.Term != child.term || !o.Held() || o.Remaining > ttl {
		t.Fatalf("Observe: holder %q term %d remaining %v; want child, term %d, at most %v", o.HolderID, o.Term, o.Remaining, child.term, ttl)
	}
	if o.AcquiredAt.After(start) || start.Sub(o.AcquiredAt) > waitTimeout {
		t.Errorf("Observe: acquired at %v; want shortly before %v", o.AcquiredAt, start)
	}
	if d := o.ExpiresAt.Sub(o.AcquiredAt); d < ttl-time.Second || d > ttl+time.Second {
		t.Errorf("Observe: expires %v after it was acquired; want about %v", d, ttl)
	}
	parent := newCandidate("parent")
	if l := mustRefuse(t, s, "job", parent, ttl); l.HolderID != "child" {
		t.Fatalf("refused acquire reports holder %q; want child", l.HolderID)
	}
	// Drain wake-ups so far; the next one is for the death.
	select {
	case <-ch:
	default:
	}

	killed := time.Now()
	child.kill()
	// Within waitTimeout, well under the TTL: the takeover does not wait
	// for the lease to run out.
	woke := waitWake(t, ch, waitTimeout, "after the holder process was killed")
	l := acquireWithin(t, s, "job", parent, ttl, waitTimeout)
	takeover := time.Since(killed)
	if l.Term != child.term+1 {
		t.Errorf("takeover has term %d; want %d", l.Term, child.term+1)
	}
	t.Logf("takeover after SIGKILL (TTL %v): watcher woke after %v, granted after %v", ttl, woke, takeover)
}

func TestHolderProcessStopsRenewing(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	s, other := open(t, dir), open(t, dir)

	const ttl = time.Second
	child := startHolder(t, dir, "job", "child", ttl)
	t0 := time.Now()
	o := mustObserve(t, s, "job")
	if o.HolderID != "child" || !o.Held() {
		t.Fatalf("Observe: holder %q held %v; want child", o.HolderID, o.Held())
	}
	notBefore := t0.Add(o.Remaining) // the store's expiry is no earlier

	parent := newCandidate("parent")
	l := acquireWithin(t, s, "job", parent, time.Hour, waitTimeout)
	if early := notBefore.Sub(time.Now()); early > 2*time.Millisecond {
		t.Fatalf("granted %v before the child's lease expired", early)
	}
	if l.Term != child.term+1 {
		t.Fatalf("grant after expiry has term %d; want %d", l.Term, child.term+1)
	}
	if !child.alive() {
		t.Fatal("child exited; the test needs it alive, holding its leader lock")
	}

	// The child still holds the leader lock, so the parent was granted the
	// lease without it. The child's death must not free the parent's lease.
	child.kill()
	carol := newCandidate("carol")
	if l := mustRefuse(t, other, "job", carol, time.Hour); l.HolderID != "parent" {
		t.Fatalf("after the old holder died, lease reported held by %q; want parent", l.HolderID)
	}

	// At its renewal the parent takes the leader lock, so from then on its
	// own death (here: closing its store) frees the lease at once.
	if _, err := s.Renew(ctxT(t), "job", parent.Token, l.Term, time.Hour); err != nil {
		t.Fatal(err)
	}
	mustRefuse(t, other, "job", carol, time.Hour)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if got := mustAcquire(t, other, "job", carol, time.Hour); got.Term != l.Term+1 {
		t.Fatalf("takeover from the parent has term %d; want %d", got.Term, l.Term+1)
	}
}

// TestElectorTakesOverFromKilledProcess: a follower Elector with a 30s TTL
// leads within waitTimeout (10s) of the leader process's SIGKILL.
func TestElectorTakesOverFromKilledProcess(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	const ttl = 30 * time.Second
	child := startHolder(t, dir, "job", "child", ttl)

	s := open(t, dir)
	_, elected := followChild(t, s, ttl)
	select {
	case term := <-elected:
		t.Fatalf("elected (term %d) while the child holds the lease", term)
	default:
	}

	killed := time.Now()
	child.kill()
	timer := time.NewTimer(waitTimeout)
	defer timer.Stop()
	select {
	case term := <-elected:
		if term != child.term+1 {
			t.Errorf("elected with term %d; want %d", term, child.term+1)
		}
		t.Logf("elector led %v after the leader process was killed (TTL %v)", time.Since(killed), ttl)
	case <-timer.C:
		t.Fatalf("elector not elected within %v of the leader's SIGKILL (TTL %v)", waitTimeout, ttl)
	}
}
