//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/leaderelect/leader/internal/pgtest"
)

// mixedTTL is the TTL of the candidates of the mixed-strategy tests: short,
// as an election moves to the other strategy a TTL after its last use.
const mixedTTL = 3 * time.Second

// refusedWithin bounds how long a "leader run" refused by the store takes
// to exit: connecting, one refused grant, and the process's start and end.
// A run that retried instead would not exit at all.
const refusedWithin = 10 * time.Second

// TestMixedStrategies runs "leader run" (and "leader once") with both
// PostgreSQL strategies on one election, on the test binary's shared
// server with a database of its own for each subtest: the store refuses
// the strategy that does not hold the election, so one election is never
// elected twice, and the refused candidate exits 125 without running its
// command, saying why and what to do.
func TestMixedStrategies(t *testing.T) {
	t.Parallel()

	for _, order := range [][2]string{{"lease", "advisory"}, {"advisory", "lease"}} {
		held, refused := order[0], order[1]
		t.Run("a run of the "+refused+" strategy on an election the "+held+" strategy holds exits 125 at once and runs nothing", func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			store := migrated(t, e)
			log := newChildLog(t, e)
			script := writeChildScript(t, e)
			startStrategyCandidate(e, log, script, store, held, held+"-0")
			waitFor(t, 20*time.Second, "the "+held+" leader's command to start", func() bool { return len(log.starts()) == 1 })

			began := time.Now()
			ran := filepath.Join(e.dir, refused+"-ran")
			_, stderr, code := e.run("run", "--store", store, "--name", "mixed", "--strategy", refused, "--ttl", mixedTTL.String(), "--", "touch", ran)
			took := time.Since(began)
			if code != exitLeaderError || took > refusedWithin {
				t.Errorf("run --strategy %s: exit %d after %v, want %d within %v\n%s", refused, code, took, exitLeaderError, refusedWithin, stderr)
			}
			if _, err := os.Stat(ran); err == nil {
				t.Errorf("run --strategy %s ran its command", refused)
			}
			checkConflictMessage(t, "run", stderr, held, refused)
			log.assertAtMostOneRunsFor(300 * time.Millisecond)
			if starts := log.starts(); len(starts) != 1 || starts[0].fields[3] != held+"-0" {
				t.Errorf("commands started: %v, want only %s-0's", starts, held)
			}
		})
	}

	t.Run("two candidates of each strategy started at once: one strategy's commands run, one at a time, the other's exit 125", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		store := migrated(t, e)
		log := newChildLog(t, e)
		script := writeChildScript(t, e)
		procs := map[string]*proc{}
		for i := range 2 {
			for _, strategy := range []string{"lease", "advisory"} {
				id := strategy + "-" + strconv.Itoa(i)
				procs[id] = startStrategyCandidate(e, log, script, store, strategy, id)
			}
		}
		waitFor(t, 20*time.Second, "a command to start", func() bool { return len(log.starts()) >= 1 })
		first := log.starts()[0]
		winner, _, _ := strings.Cut(first.fields[3], "-")
		loser := "lease"
		if winner == "lease" {
			loser = "advisory"
		}
		t.Logf("the %s strategy won", winner)
		// The other strategy's candidates are refused; a refusal that
		// came while the winner's grant was under way (the election not
		// yet held) waits a TTL for the election to move, and is refused
		// then.
		for i := range 2 {
			p := procs[loser+"-"+strconv.Itoa(i)]
			if code := p.wait(mixedTTL + 2*refusedWithin); code != exitLeaderError {
				t.Errorf("%s-%d: exit %d, want %d\n%s", loser, i, code, exitLeaderError, p.stderr.String())
			}
			checkConflictMessage(t, "run", p.stderr.String(), winner, loser)
		}
		log.assertAtMostOneRunsFor(500 * time.Millisecond)

		// The winner's follower takes over when the leader stops; no
		// command of the other strategy ever runs.
		leader := procs[first.fields[3]]
		leader.signal(syscall.SIGTERM)
		if code := leader.wait(10 * time.Second); code != 0 {
			t.Errorf("the leader stopped by SIGTERM exited %d, want 0", code)
		}
		waitFor(t, 20*time.Second, "the follower's command to start", func() bool { return len(log.starts()) >= 2 })
		log.assertAtMostOneRunsFor(300 * time.Millisecond)
		log.checkNoOverlap()
		for _, s := range log.starts() {
			if !strings.HasPrefix(s.fields[3], winner+"-") {
				t.Errorf("a command of %s ran, but the %s strategy holds the election\nlog:\n%s", s.fields[3], winner, log)
			}
		}
		if starts := log.starts(); len(starts) != 2 || starts[1].fields[3] == starts[0].fields[3] {
			t.Errorf("commands started: %v, want the leader's, then its follower's\nlog:\n%s", starts, log)
		}
	})

	t.Run("once, which uses the lease strategy, exits 125 and runs nothing while an advisory run holds the election", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		store := migrated(t, e)
		log := newChildLog(t, e)
		startStrategyCandidate(e, log, writeChildScript(t, e), store, "advisory", "advisory-0")
		waitFor(t, 20*time.Second, "the advisory leader's command to start", func() bool { return len(log.starts()) == 1 })
		ran := filepath.Join(e.dir, "once-ran")
		began := time.Now()
		_, stderr, code := e.run("once", "--store", store, "--name", "mixed", "--", "touch", ran)
		if took := time.Since(began); code != exitLeaderError || took > refusedWithin {
			t.Errorf("once: exit %d after %v, want %d within %v\n%s", code, took, exitLeaderError, refusedWithin, stderr)
		}
		if _, err := os.Stat(ran); err == nil {
			t.Error("once ran its command")
		}
		checkConflictMessage(t, "once", stderr, "advisory", "lease")
		if !strings.Contains(stderr, `"leader once" always uses the lease strategy`) {
			t.Errorf("once does not say that it uses the lease strategy:\n%s", stderr)
		}
	})

	t.Run("moving an election: started after the old strategy's leader stopped, a run waits a TTL and leads", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		store := migrated(t, e)
		log := newChildLog(t, e)
		script := writeChildScript(t, e)
		old := startStrategyCandidate(e, log, script, store, "lease", "lease-0")
		waitFor(t, 20*time.Second, "the lease leader's command to start", func() bool { return len(log.starts()) == 1 })
		old.signal(syscall.SIGTERM)
		stoppedAt := time.Now()
		if code := old.wait(10 * time.Second); code != 0 {
			t.Fatalf("the lease leader stopped by SIGTERM exited %d, want 0", code)
		}
		moved := startStrategyCandidate(e, log, script, store, "advisory", "advisory-0")
		waitFor(t, mixedTTL+20*time.Second, "the advisory candidate's command to start", func() bool {
			return len(log.starts()) == 2 || moved.exited()
		})
		if moved.exited() {
			t.Fatalf("the advisory candidate exited %d instead of waiting for the election to move\n%s", moved.code, moved.stderr.String())
		}
		starts := log.starts()
		if wait := starts[1].at.Sub(stoppedAt); wait < mixedTTL-100*time.Millisecond {
			t.Errorf("the advisory command started %v after the lease leader was stopped, want a TTL (%v) or more", wait, mixedTTL)
		}
		if mustAtoi(t, starts[1].fields[4]) <= mustAtoi(t, starts[0].fields[4]) {
			t.Errorf("LEADER_TERM went from %s to %s, want it to grow across strategies", starts[0].fields[4], starts[1].fields[4])
		}
		if !strings.Contains(moved.stderr.String(), "it can move to the advisory strategy at") {
			t.Errorf("the advisory candidate does not say when the election can move:\n%s", moved.stderr.String())
		}
		log.checkNoOverlap()
	})

	t.Run("run against a database never migrated exits 125 at once and says to run leader migrate", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		ran := filepath.Join(e.dir, "ran")
		began := time.Now()
		_, stderr, code := e.run("run", "--store", pgtest.NewDatabase(t), "--name", "x", "--", "touch", ran)
		if took := time.Since(began); code != exitLeaderError || took > refusedWithin || !strings.Contains(stderr, "leader migrate") {
			t.Errorf("run before migrate: exit %d after %v, want %d within %v and a word on leader migrate\n%s", code, took, exitLeaderError, refusedWithin, stderr)
		}
		if _, err := os.Stat(ran); err == nil {
			t.Error("the command ran")
		}
	})

	t.Run("a store that refuses the first grant: run exits 125 at once and prints why once", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		store := migrated(t, e)
		// A schema from before the strategy table: the lease table is
		// there, so the store opens, but the grant is refused.
		pool := pgtest.OpenPool(t, store)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if _, err := pool.Exec(ctx, "DROP TABLE public.leader_strategies"); err != nil {
			t.Fatal(err)
		}
		ran := filepath.Join(e.dir, "ran")
		began := time.Now()
		_, stderr, code := e.run("run", "--store", store, "--name", "x", "--", "touch", ran)
		if took := time.Since(began); code != exitLeaderError || took > refusedWithin {
			t.Errorf("run: exit %d after %v, want %d within %v\n%s", code, took, exitLeaderError, refusedWithin, stderr)
		}
		if n := strings.Count(stderr, "leader migrate"); n != 1 || !strings.HasPrefix(lastLine(stderr), "leader run: ") ||
			!strings.Contains(lastLine(stderr), "leader migrate") || strings.Contains(stderr, "level=ERROR") {
			t.Errorf("run does not say once, in its last line, to run leader migrate (%d times):\n%s", n, stderr)
		}
		if _, err := os.Stat(ran); err == nil {
			t.Error("the command ran")
		}
	})
}

// migrated returns a fresh database's URL, migrated with "leader migrate".
func migrated(t *testing.T, e *env) string {
	t.Helper()
	u := pgtest.NewDatabase(t)
	out, stderr, code := e.run("migrate", "--store", u)
	if code != 0 || !strings.Contains(out, "up to date") {
		t.Fatalf("migrate: exit %d\n%s%s", code, out, stderr)
	}
	return u
}

// writeChildScript writes the child script (see childScript) into e's
// directory and returns its path.
func writeChildScript(t *testing.T, e *env) string {
	t.Helper()
	script := filepath.Join(e.dir, "child.sh")
	if err := os.WriteFile(script, []byte(childScript), 0o755); err != nil {
		t.Fatal(err)
	}
	return script
}

// startStrategyCandidate starts "leader run --strategy strategy" as id in
// the election "mixed", running the child script, which logs to log.
func startStrategyCandidate(e *env, log childLog, script, store, strategy, id string) *proc {
	return e.with("CHILD_LOG="+log.path).start("run", "--store", store, "--name", "mixed", "--id", id,
		"--strategy", strategy, "--ttl", mixedTTL.String(), "--", "sh", script)
}

// checkConflictMessage checks what a refused "leader cmd" printed: once,
// as its last line, that the election is elected with the held strategy
// and this candidate uses the refused one, and what to do; and no log
// record at ERROR that says it again.
func checkConflictMessage(t *testing.T, cmd, stderr, held, refused string) {
	t.Helper()
	last := lastLine(stderr)
	for _, want := range []string{
		"leader " + cmd + `: election "mixed" is elected with the ` + held + " strategy",
		"this candidate uses the " + refused + " strategy",
		"stop every " + held + " candidate",
	} {
		if !strings.Contains(last, want) {
			t.Errorf("leader %s's last line does not say %q:\n%s", cmd, want, stderr)
		}
	}
	if n := strings.Count(stderr, "one strategy only"); n != 1 || strings.Contains(stderr, "level=ERROR") {
		t.Errorf("leader %s says why it was refused %d times, want once, not in a log record:\n%s", cmd, n, stderr)
	}
}

func lastLine(s string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return lines[len(lines)-1]
}

func mustAtoi(t *testing.T, s string) int {
	t.Helper()
	n, err := strconv.Atoi(s)
	if err != nil {
		t.Fatalf("%q: %v", s, err)
	}
	return n
}
