//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package filelock_test

import (
	"bufio"
	"bytes"
	"io"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/leaderelect/leader"
)

// holder is a child process holding a lease.
type holder struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	stderr bytes.Buffer
	term   uint64
}

// startChild starts this test binary again as a child (see helperMain)
// with the environment env added, and returns it with a channel that
// receives each line of its standard output. The child is killed when the
// test ends.
func startChild(t *testing.T, env ...string) (*holder, <-chan string) {
	t.Helper()
	h := &holder{cmd: exec.Command(os.Args[0], "-test.run=^$")}
	h.cmd.Env = append(append(os.Environ(), helperEnv+"=1"), env...)
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

	lines := make(chan string, 16)
	go func() {
		defer close(lines)
		in := bufio.NewScanner(stdout) // until the child exits
		for in.Scan() {
			lines <- in.Text()
		}
	}()
	return h, lines
}

// startHolder starts a child that acquires name in dir as id for ttl, and
// waits until it has been granted the lease.
func startHolder(t *testing.T, dir, name, id string, ttl time.Duration) *holder {
	t.Helper()
	h, lines := startChild(t, helperDirEnv+"="+dir, helperNameEnv+"="+name, helperIDEnv+"="+id, helperTTLEnv+"="+ttl.String())
	h.term = h.awaitTerm(t, lines, "granted")
	go func() {
		for range lines { // "released"
		}
	}()
	return h
}

// startElector starts a child that runs an Elector for name in dir as id
// with ttl. The returned channel receives the term of each grant to it.
func startElector(t *testing.T, dir, name, id string, ttl time.Duration) (*holder, <-chan uint64) {
	t.Helper()
	h, lines := startChild(t, helperModeEnv+"=elector",
		helperDirEnv+"="+dir, helperNameEnv+"="+name, helperIDEnv+"="+id, helperTTLEnv+"="+ttl.String())
	elected := make(chan uint64, 8)
	go func() {
		defer close(elected)
		for s := range lines {
			term, err := strconv.ParseUint(strings.TrimPrefix(s, "elected "), 10, 64)
			if err == nil {
				elected <- term
			}
		}
	}()
	return h, elected
}

// awaitTerm waits for the child's first line of output, "<what> <term>",
// and returns the term.
func (h *holder) awaitTerm(t *testing.T, lines <-chan string, what string) uint64 {
	t.Helper()
	timer := time.NewTimer(waitTimeout)
	defer timer.Stop()
	select {
	case s := <-lines:
		term, err := strconv.ParseUint(strings.TrimPrefix(strings.TrimSpace(s), what+" "), 10, 64)
		if err != nil {
			h.kill()
			t.Fatalf("child did not print %q and a term: stdout %q, stderr %q", what, s, h.stderr.String())
		}
		return term
	case <-timer.C:
		h.kill()
		t.Fatalf("child did not print %q within %v; stderr %q", what, waitTimeout, h.stderr.String())
	}
	return 0
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

// TestTransferBetweenProcesses: leadership moves between processes to the
// candidate named, with the next term and reason "transfer", while another
// candidate waits: from an Elector of this process, by its Transfer, to a
// leader in a child process, which takes it at once, woken by the release;
// and back, by a request from any process (leader.RequestTransfer), which
// the child acts on at its next renewal.
func TestTransferBetweenProcesses(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	const ttl = 3 * time.Second
	carol, carolElected := runElector(t, open(t, dir), "carol", ttl)
	term := awaitElected(t, carolElected, 0, "carol")
	_, childElected := startElector(t, dir, "job", "child", ttl)
	_, bobElected := runElector(t, open(t, dir), "bob", ttl)
	s := open(t, dir)
	waitCandidates(t, s, "job", "bob", "child")

	start := time.Now()
	l, err := carol.Transfer(ctxT(t), "child")
	took := time.Since(start)
	if err != nil {
		t.Fatalf("carol's Transfer to the child: %v", err)
	}
	if l.HolderID != "child" || l.Term != term+1 || l.Reason != leader.GrantTransfer {
		t.Fatalf("carol's Transfer returned holder %q term %d reason %q; want child, term %d, reason %q", l.HolderID, l.Term, l.Reason, term+1, leader.GrantTransfer)
	}
	awaitElected(t, childElected, term+1, "the child")
	// The child learns of the release from the kernel (or a poll), not at
	// the end of carol's lease.
	if took > ttl/2 {
		t.Errorf("carol's Transfer took %v; want well under the TTL (%v)", took, ttl)
	}
	t.Logf("carol handed over to the child process in %v (step-down, release, wake-up, grant)", took)

	// Carol, who led first and so never enlisted, enlists while she sits
	// out after the handover.
	waitCandidates(t, s, "job", "bob", "carol")
	start = time.Now()
	l, err = leader.RequestTransfer(ctxT(t), s, "job", "carol")
	if err != nil {
		t.Fatalf("RequestTransfer to carol: %v", err)
	}
	if l.HolderID != "carol" || l.Term != term+2 || l.Reason != leader.GrantTransfer {
		t.Fatalf("RequestTransfer to carol returned holder %q term %d reason %q; want carol, term %d, reason %q", l.HolderID, l.Term, l.Reason, term+2, leader.GrantTransfer)
	}
	awaitElected(t, carolElected, term+2, "carol")
	t.Logf("the child process handed back to carol %v after the request (TTL %v: the leader acts at its next renewal)", time.Since(start), ttl)
	select {
	case term := <-bobElected:
		t.Fatalf("bob was elected (term %d) during handovers to others", term)
	default:
	}
}

// awaitElected waits for the next term on elected, which must be want
// unless want is 0, and returns it.
func awaitElected(t *testing.T, elected <-chan uint64, want uint64, who string) uint64 {
	t.Helper()
	timer := time.NewTimer(waitTimeout)
	defer timer.Stop()
	select {
	case term, ok := <-elected:
		if !ok {
			t.Fatalf("%s exited before it was elected", who)
		}
		if want != 0 && term != want {
			t.Fatalf("%s elected with term %d; want %d", who, term, want)
		}
		return term
	case <-timer.C:
		t.Fatalf("%s not elected within %v", who, waitTimeout)
	}
	return 0
}

// waitCandidates waits until the candidates of name on s include ids.
func waitCandidates(t *testing.T, s leader.Transferer, name string, ids ...string) {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for {
		cands, err := s.Candidates(ctxT(t), name)
		if err != nil {
			t.Fatalf("Candidates: %v", err)
		}
		missing := slices.DeleteFunc(slices.Clone(ids), func(id string) bool {
			return slices.ContainsFunc(cands, func(c leader.Candidate) bool { return c.ID == id })
		})
		if len(missing) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%v not among the candidates within %v: %v", missing, waitTimeout, cands)
		}
		time.Sleep(5 * time.Millisecond) // poll interval
	}
}
