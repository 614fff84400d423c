//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/leaderelect/leader/cmd/leader/internal/fence"
)

// frozenLeader elects instance a on store with a 2s TTL, with b following,
// then freezes a's "leader run" process (SIGSTOP; its supervisor and its
// command run on). The supervisor's dead-man's switch must stop a's command
// before a's lease could run out, so before b's command starts; resumed, a
// must find its leadership lost and not start its command again.
func frozenLeader(t *testing.T, e *env, store string) {
	log := newChildLog(t, e)
	script := filepath.Join(e.dir, "child.sh")
	if err := os.WriteFile(script, []byte(childScript), 0o755); err != nil {
		t.Fatal(err)
	}
	ce := e.with("CHILD_LOG=" + log.path)
	args := func(id string) []string {
		return []string{"run", "--store", store, "--name", "frozen", "--id", id, "--ttl", "2s", "--", "sh", script}
	}
	a := ce.start(args("a")...)
	waitFor(t, 20*time.Second, "a's command to start", func() bool { return len(log.starts()) >= 1 })
	b := ce.start(args("b")...)
	first := log.starts()[0]
	if first.fields[3] != "a" {
		t.Fatalf("first command started by %s, want a", first.fields[3])
	}

	a.signal(syscall.SIGSTOP)
	frozenAt := time.Now()
	waitFor(t, 10*time.Second, "the frozen leader's command to be stopped", func() bool { return !pidAlive(first.pid) })
	gone := time.Since(frozenAt)
	waitFor(t, 10*time.Second, "b's command to start", func() bool { return len(log.starts()) >= 2 })
	second := log.starts()[1]
	if second.fields[3] != "b" {
		t.Errorf("second command started by %s, want b", second.fields[3])
	}
	var stopped time.Time
	for _, ev := range log.events() {
		if ev.kind == "stop" && ev.pid == first.pid {
			stopped = ev.at
		}
	}
	// The stop point is at most TTL - drift margin - StopGrace (1.5s)
	// after the last renewal, which came before SIGSTOP; the lease runs out
	// 2s after it.
	if stopped.IsZero() || stopped.Sub(frozenAt) > 2*time.Second || !stopped.Before(second.at) {
		t.Errorf("a's command logged its stop (SIGTERM) %v after SIGSTOP, b's started %v after\nlog:\n%s",
			stopped.Sub(frozenAt), second.at.Sub(frozenAt), log)
	}
	log.checkNoOverlap()
	t.Logf("frozen leader's command: SIGTERM %v after SIGSTOP, gone (seen) %v after; next command started %v after",
		stopped.Sub(frozenAt).Round(time.Millisecond), gone.Round(time.Millisecond), second.at.Sub(frozenAt).Round(time.Millisecond))

	// Resumed, a finds out it lost the lease and does not start its
	// command again while b leads.
	a.signal(syscall.SIGCONT)
	waitFor(t, 10*time.Second, "the resumed instance to step down", func() bool {
		return strings.Contains(a.stderr.String(), "demoted")
	})
	log.assertAtMostOneRunsFor(500 * time.Millisecond)
	if n := len(log.starts()); n != 2 || a.exited() || b.exited() {
		t.Errorf("after a resumed: %d commands started (want 2), a exited %v, b exited %v\nlog:\n%s", n, a.exited(), b.exited(), log)
	}
	if !pidAlive(second.pid) {
		t.Errorf("b's command %d no longer runs", second.pid)
	}
}

func TestRunFrozenLeaderStopsItsCommandOnTheEmbeddedStore(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	frozenLeader(t, e, e.fileStore())
}

// Ctrl-Z (SIGTSTP), SIGTTIN and SIGTTOU do not stop "leader run": a
// stopped leader could not act on the loss of its lease.
func TestRunIgnoresJobControlStops(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ready := filepath.Join(e.dir, "ready")
	p := e.start("run", "--store", e.fileStore(), "--name", "tstp", "--", "sh", "-c", `touch "`+ready+`"; exec sleep 1000`)
	waitFor(t, 20*time.Second, "the command to start", func() bool { _, err := os.Stat(ready); return err == nil })
	for _, sig := range []syscall.Signal{syscall.SIGTSTP, syscall.SIGTTIN, syscall.SIGTTOU} {
		p.signal(sig)
	}
	// A stopped process would leave SIGTERM pending and not exit.
	p.signal(syscall.SIGTERM)
	if code := p.wait(10 * time.Second); code != 0 {
		t.Errorf("exit code %d", code)
	}
}

// Two instances of one election on one embedded store share its fence,
// whatever their XDG_RUNTIME_DIR and TMPDIR, and whether they name the
// store through a symlink or not.
func TestRunFenceIsSharedWhateverTheEnvironment(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	real := filepath.Join(e.dir, "store")
	if err := os.MkdirAll(real, 0o700); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(e.dir, "link")
	if err := os.Symlink(real, link); err != nil {
		t.Fatal(err)
	}
	spec, err := parseStoreURL("file://" + real)
	if err != nil {
		t.Fatal(err)
	}
	s, err := openStore(context.Background(), spec, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	path := s.fencePath("f")
	s.Close()
	if !strings.HasPrefix(path, real+string(filepath.Separator)) {
		t.Errorf("fence %s is not in the store's directory %s", path, real)
	}

	// One instance, through the symlink, in one environment: while its
	// command runs, its supervisor holds the fence named for the real path.
	env1 := e.with("XDG_RUNTIME_DIR="+filepath.Join(e.dir, "run1"), "TMPDIR="+filepath.Join(e.dir, "tmp1"))
	ready := filepath.Join(e.dir, "ready")
	p1 := env1.start("run", "--store", "file://"+link, "--name", "f", "--", "sh", "-c", `touch "`+ready+`"; exec sleep 1000`)
	waitFor(t, 20*time.Second, "the first command to start", func() bool { _, err := os.Stat(ready); return err == nil })
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	if f, err := fence.Acquire(ctx, path, nil); err == nil {
		f.Close()
		t.Errorf("the fence %s is free while the first instance's command runs", path)
	}
	cancel()
	p1.signal(syscall.SIGTERM)
	if code := p1.wait(10 * time.Second); code != 0 {
		t.Errorf("first instance: exit code %d", code)
	}

	// Another, by the real path, in another environment, waits for the
	// fence (held here, as a dying leader's supervisor would) before it
	// starts its command.
	held, err := fence.Acquire(context.Background(), path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	env2 := e.with("XDG_RUNTIME_DIR="+filepath.Join(e.dir, "run2"), "TMPDIR="+filepath.Join(e.dir, "tmp2"))
	ran := filepath.Join(e.dir, "ran")
	p2 := env2.start("run", "--store", "file://"+real, "--name", "f", "--", "sh", "-c", `touch "`+ran+`"; exec sleep 1000`)
	waitFor(t, 20*time.Second, "the second instance to wait for the fence", func() bool {
		return strings.Contains(p2.stderr.String(), "waiting for the previous command")
	})
	if _, err := os.Stat(ran); err == nil {
		t.Fatal("the second command started while the fence was held")
	}
	held.Close()
	waitFor(t, 20*time.Second, "the second command to start once the fence is free", func() bool { _, err := os.Stat(ran); return err == nil })
	p2.signal(syscall.SIGTERM)
	p2.wait(10 * time.Second)
}
