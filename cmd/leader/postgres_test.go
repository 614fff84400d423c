//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"bufio"
	"encoding/json"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/leaderelect/leader/internal/pgtest"
)

// TestPostgres runs the end-to-end scenarios on PostgreSQL: the test
// binary's shared server (a throwaway cluster, or LEADER_TEST_DATABASE_URL),
// with a database of its own for each subtest.
func TestPostgres(t *testing.T) {
	t.Parallel()

	t.Run("migrate is needed first, and may run again", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		u := pgtest.NewDatabase(t)
		_, stderr, code := e.run("status", "--store", u, "--name", "x")
		if code != exitFailure || !strings.Contains(stderr, `run "leader migrate"`) {
			t.Errorf("status before migrate: exit %d\n%s", code, stderr)
		}
		for range 2 {
			if out, stderr, code := e.run("migrate", "--store", u); code != 0 {
				t.Fatalf("migrate: exit %d\n%s%s", code, out, stderr)
			}
		}
		if out, stderr, code := e.run("status", "--store", u, "--name", "x"); code != 0 || !strings.Contains(out, "none (never granted)") {
			t.Errorf("status after migrate: exit %d\n%s%s", code, out, stderr)
		}
	})

	t.Run("advisory: migrate is needed first too", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		u := pgtest.NewDatabase(t)
		ran := filepath.Join(e.dir, "ran")
		_, stderr, code := e.run("run", "--store", u, "--strategy", "advisory", "--name", "x", "--", "touch", ran)
		if code != exitLeaderError || !strings.Contains(stderr, `run "leader migrate"`) || !strings.Contains(stderr, "advisory") {
			t.Errorf("run --strategy advisory before migrate: exit %d, want %d and a word on migrate\n%s", code, exitLeaderError, stderr)
		}
		if _, err := os.Stat(ran); err == nil {
			t.Error("the command ran")
		}
	})

	t.Run("advisory: a killed leader is replaced without waiting for the TTL, and SIGTERM hands over", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		advisoryFailover(t, e, migrated(t, e))
	})

	t.Run("advisory: status and watch find the strategy in the store and show the leader", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		advisoryStatus(t, e, migrated(t, e))
	})

	t.Run("advisory: refused behind PgBouncer in transaction mode, where the lease strategy works", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		bouncer := pgtest.PgBouncer(t, migrated(t, e), "transaction")
		ran := filepath.Join(e.dir, "ran")
		for _, args := range [][]string{
			{"run", "--store", bouncer, "--strategy", "advisory", "--name", "pooled", "--", "touch", ran},
			{"status", "--store", bouncer, "--strategy", "advisory", "--name", "pooled"},
			{"watch", "--store", bouncer, "--strategy", "advisory", "--name", "pooled"},
		} {
			out, stderr, code := e.run(args...)
			if want := usageCode(args); code != want || out != "" {
				t.Errorf("%s through PgBouncer: exit %d, want %d, and no output\n%s%s", args[0], code, want, out, stderr)
			}
			for _, want := range []string{"--strategy advisory needs a direct connection", "pooler", "PgBouncer", "--strategy lease"} {
				if !strings.Contains(stderr, want) {
					t.Errorf("%s through PgBouncer: the message does not say %q:\n%s", args[0], want, stderr)
				}
			}
		}
		if _, err := os.Stat(ran); err == nil {
			t.Error("the command ran with --strategy advisory through PgBouncer")
		}
		if _, stderr, code := e.run("run", "--store", bouncer, "--name", "pooled", "--", "touch", ran); code != 0 {
			t.Errorf("run with the lease strategy through PgBouncer: exit %d\n%s", code, stderr)
		}
		if _, err := os.Stat(ran); err != nil {
			t.Errorf("the lease strategy did not run the command through PgBouncer: %v", err)
		}
	})

	t.Run("advisory: demo", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		out, stderr, code := e.run("demo", "--store", migrated(t, e), "--strategy", "advisory")
		checkDemo(t, out, stderr, code)
		if !strings.Contains(out, "advisory strategy") || !strings.Contains(out, "--strategy advisory") {
			t.Errorf("the demo does not say it uses the advisory strategy:\n%s", out)
		}
		// The demo's TTL is 2s: a takeover within it did not wait for it.
		m := regexp.MustCompile(`takeover after SIGKILL of the leader:\s+(\S+)`).FindStringSubmatch(out)
		if m == nil {
			t.Fatalf("no takeover delay in the demo's output:\n%s", out)
		}
		if d, err := time.ParseDuration(m[1]); err != nil || d >= 2*time.Second {
			t.Errorf("takeover after SIGKILL took %s, want under the 2s TTL (%v)", m[1], err)
		}
	})

	t.Run("three candidates: one child, SIGKILL takeover, SIGTERM handover", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		u := migrated(t, e)
		failover(t, e, u, "2s", 20*time.Second)
	})

	t.Run("a frozen leader's command is stopped before the lease passes on", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		frozenLeader(t, e, migrated(t, e))
	})

	t.Run("run and once say that they elect among every host that reaches the database", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		u, err := url.Parse(migrated(t, e))
		if err != nil {
			t.Fatal(err)
		}
		// The test server trusts every login: the password is never asked
		// for, only shown (masked).
		const secret = "Pa55wordNeverShown"
		u.User = url.UserPassword(u.User.Username(), secret)
		masked := u.User.Username() + ":xxxxx@" + u.Host + u.Path
		for _, cmd := range []string{"run", "once"} {
			_, stderr, code := e.run(cmd, "--store", u.String(), "--name", "scope-"+cmd, "--", "true")
			if code != 0 || strings.Contains(stderr, secret) {
				t.Errorf("%s: exit %d, or the password shows\n%s", cmd, code, stderr)
			}
			for _, want := range []string{`level=INFO msg=electing store="postgres://` + masked, `scope="every host that reaches this database"`} {
				if !strings.Contains(stderr, want) {
					t.Errorf("%s does not log %q:\n%s", cmd, want, stderr)
				}
			}
		}
	})

	t.Run("once runs one of concurrent invocations and keeps the window after the run", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		u := migrated(t, e)
		onceConcurrently(t, e, u, 4)
		// A firing within the window after the run finds it taken.
		ran := filepath.Join(e.dir, "late")
		out, stderr, code := e.run("once", "--store", u, "--name", "nightly", "--window", "1m", "--", "sh", "-c", "touch "+ran)
		if code != 0 || out != "" || !onlyInfo(stderr) {
			t.Errorf("late firing: exit %d, output %q %q", code, out, stderr)
		}
		if _, err := os.Stat(ran); err == nil {
			t.Error("a firing within the window after the run ran the job again")
		}
		// Status shows the lease kept for the window, held by the winner.
		out, _, _ = e.run("status", "--store", u, "--name", "nightly", "--json")
		if !strings.Contains(out, `"held":true`) {
			t.Errorf("the lease is not kept after the run: %s", out)
		}
	})

	t.Run("a password in the URL shows nowhere while it works", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		u, err := url.Parse(migrated(t, e))
		if err != nil {
			t.Fatal(err)
		}
		secret, ok := u.User.Password()
		if !ok || secret == "" {
			secret = "An0therS3cretPw"
			u.User = url.UserPassword(u.User.Username(), secret) // the throwaway cluster trusts local connections
		}
		withPW := u.String()
		_, stderr, code := e.run("run", "--store", withPW, "--name", "pw", "--log-level", "debug", "--", "true")
		if code != 0 {
			t.Fatalf("run: exit %d\n%s", code, stderr)
		}
		if strings.Contains(stderr, secret) || !strings.Contains(stderr, "xxxxx") {
			t.Errorf("run's log shows the password, or no masked store URL:\n%s", stderr)
		}
		w := e.start("watch", "--store", withPW, "--name", "pw", "--log-level", "debug", "--log-format", "json")
		waitFor(t, 20*time.Second, "watch's first line", func() bool { return w.stdout.String() != "" })
		w.signal(syscall.SIGTERM)
		w.wait(10 * time.Second)
		if strings.Contains(w.stdout.String()+w.stderr.String(), secret) {
			t.Errorf("watch shows the password")
		}
	})

	t.Run("demo", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		u := migrated(t, e)
		out, stderr, code := e.run("demo", "--store", u)
		checkDemo(t, out, stderr, code)
	})
}

// advisoryTTL is the TTL of the advisory strategy's end-to-end tests: long,
// so that a takeover well within it shows that nothing waited for it.
const (
	advisoryTTL      = "10s"
	advisoryTakeover = 5 * time.Second
)

// advisoryFailover runs two "leader run --strategy advisory" candidates on
// store: exactly one runs its command; SIGKILL to the leading "leader"
// process has the other one's command start well within the TTL (the
// server frees a dead session's lock), after the killed leader's command
// is gone; then, with a third candidate waiting, SIGTERM to the new leader
// hands over at once.
func advisoryFailover(t *testing.T, e *env, store string) {
	log := newChildLog(t, e)
	procs := e.candidates(2, log, store, "--strategy", "advisory", "--ttl", advisoryTTL)

	waitFor(t, 20*time.Second, "the first child to start", func() bool { return len(log.starts()) >= 1 })
	log.assertAtMostOneRunsFor(time.Second)
	if n := len(log.starts()); n != 1 {
		t.Fatalf("%d children started, want 1\nlog:\n%s", n, log)
	}
	first := log.starts()[0]
	firstTerm, _ := strconv.Atoi(first.fields[4])
	if firstTerm < 1 || first.fields[5] != "1" {
		t.Fatalf("child environment LEADER_ID, LEADER_TERM, LEADER_HELD, LEADER_NAME = %v", first.fields[3:])
	}

	killed := procs[first.fields[3]]
	killed.signal(syscall.SIGKILL)
	killedAt := time.Now()
	waitFor(t, 20*time.Second, "the other child after SIGKILL of the leader", func() bool { return len(log.starts()) >= 2 })
	second := log.starts()[1]
	takeover := second.at.Sub(killedAt)
	t.Logf("advisory strategy: takeover after SIGKILL of the leader: %v (TTL %s)", takeover.Round(time.Millisecond), advisoryTTL)
	if takeover > advisoryTakeover {
		t.Errorf("takeover after SIGKILL took %v, want under %v: it waited for the %s TTL", takeover, advisoryTakeover, advisoryTTL)
	}
	if second.fields[3] == first.fields[3] {
		t.Errorf("the killed candidate %s leads again", first.fields[3])
	}
	if term, _ := strconv.Atoi(second.fields[4]); term <= firstTerm {
		t.Errorf("LEADER_TERM went from %d to %d, want it to grow", firstTerm, term)
	}
	if pidAlive(first.pid) {
		t.Errorf("the killed leader's child %d still runs", first.pid)
	}
	log.checkNoOverlap()
	if code := killed.wait(10 * time.Second); code != 128+int(syscall.SIGKILL) {
		t.Errorf("killed leader exit code %d", code)
	}

	// A third candidate waits; SIGTERM to the leader hands over to it.
	third := e.with("CHILD_LOG="+log.path).start("run", "--store", store, "--name", "e2e", "--id", "c2",
		"--strategy", "advisory", "--ttl", advisoryTTL, "--", "sh", filepath.Join(e.dir, "child.sh"))
	waitFor(t, 20*time.Second, "the third candidate to campaign", func() bool {
		return strings.Contains(third.stderr.String(), "msg=electing")
	})
	log.assertAtMostOneRunsFor(500 * time.Millisecond)
	stopped := procs[second.fields[3]]
	stopped.signal(syscall.SIGTERM)
	termAt := time.Now()
	waitFor(t, 20*time.Second, "a third child after SIGTERM of the leader", func() bool { return len(log.starts()) >= 3 })
	next := log.starts()[2]
	handover := next.at.Sub(termAt)
	t.Logf("advisory strategy: handover after SIGTERM: %v", handover.Round(time.Millisecond))
	if next.fields[3] != "c2" {
		t.Errorf("after SIGTERM, %s leads, want c2", next.fields[3])
	}
	if handover > advisoryTakeover {
		t.Errorf("handover after SIGTERM took %v, want under %v", handover, advisoryTakeover)
	}
	if code := stopped.wait(10 * time.Second); code != 0 {
		t.Errorf("leader stopped by SIGTERM exited %d, want 0", code)
	}
	var stopAt time.Time
	for _, ev := range log.events() {
		if ev.kind == "stop" && ev.pid == second.pid {
			stopAt = ev.at
		}
	}
	if stopAt.IsZero() || stopAt.After(next.at) {
		t.Errorf("the stopped leader's child logged its stop at %v, not before the next child started at %v\nlog:\n%s", stopAt, next.at, log)
	}
	log.checkNoOverlap()
	log.assertAtMostOneRunsFor(300 * time.Millisecond)
}

// advisoryStatus checks status and watch on an election led with the
// advisory strategy: they find the strategy in the store, so without
// --strategy (or with the wrong one, which adds a note on stderr) they show
// the leader and its term, and watch sees a killed leader go well within
// the TTL; a watch started before the election was first elected follows
// it to the advisory strategy.
func advisoryStatus(t *testing.T, e *env, store string) {
	status := func(name string, args ...string) (map[string]any, string) {
		t.Helper()
		out, stderr, code := e.run(append([]string{"status", "--store", store, "--name", name, "--json"}, args...)...)
		var st map[string]any
		if code != 0 || json.Unmarshal([]byte(out), &st) != nil {
			t.Fatalf("status %v: exit %d, output %q\n%s", args, code, out, stderr)
		}
		return st, stderr
	}

	// A watch that starts before anyone was elected (the lease strategy's
	// store, then) must show the advisory leader when there is one.
	early := e.start("watch", "--store", store, "--name", "adv", "--json")
	waitFor(t, 20*time.Second, "the early watch's first line", func() bool { return len(watchLines(t, early)) > 0 })
	if l := watchLines(t, early)[0]; l["leader"] != nil || l["term"].(float64) != 0 {
		t.Errorf("watch before any election: %v, want no leader and term 0", l)
	}

	r := e.start("run", "--store", store, "--name", "adv", "--id", "alpha", "--strategy", "advisory", "--ttl", advisoryTTL, "--", "sleep", "1000")
	waitFor(t, 20*time.Second, "status to show alpha leading", func() bool {
		st, _ := status("adv")
		return st["leader"] == "alpha"
	})
	st, stderr := status("adv")
	if st["held"] != true || st["term"].(float64) < 1 || st["expires_at"] == nil || st["acquired_at"] == nil ||
		st["remaining_seconds"].(float64) <= 0 || stderr != "" {
		t.Errorf("status --json without --strategy: %v\n%s", st, stderr)
	}
	term := st["term"].(float64)
	text, stderr, code := e.run("status", "--store", store, "--name", "adv")
	if code != 0 || !strings.Contains(text, "alpha") || !strings.Contains(text, "term      "+strconv.Itoa(int(term))) || stderr != "" {
		t.Errorf("status without --strategy: exit %d\n%s%s", code, text, stderr)
	}
	if st, stderr := status("adv", "--strategy", "advisory"); st["leader"] != "alpha" || stderr != "" {
		t.Errorf("status --strategy advisory: %v\n%s", st, stderr)
	}
	// The wrong --strategy is overruled by the store, with a note.
	st, stderr = status("adv", "--strategy", "lease")
	if st["leader"] != "alpha" || st["term"].(float64) != term {
		t.Errorf("status --strategy lease of an advisory election: %v, want alpha and term %v", st, term)
	}
	for _, want := range []string{"note", `"adv" is elected with the advisory strategy`, "--strategy lease"} {
		if !strings.Contains(stderr, want) {
			t.Errorf("status --strategy lease of an advisory election does not say %q on stderr:\n%s", want, stderr)
		}
	}
	waitFor(t, 20*time.Second, "the early watch to show alpha", func() bool {
		l := watchLines(t, early)
		return l[len(l)-1]["leader"] == "alpha"
	})
	if l := watchLines(t, early); len(l) != 2 || l[1]["term"].(float64) != term {
		t.Errorf("the early watch printed %v, want none, then alpha with term %v", l, term)
	}

	// watch without --strategy: its first line shows the leader, and it
	// sees a killed leader go without waiting for the TTL (the store's
	// lock waiter wakes it).
	w := e.start("watch", "--store", store, "--name", "adv", "--json")
	waitFor(t, 20*time.Second, "watch's first line", func() bool { return len(watchLines(t, w)) > 0 })
	if l := watchLines(t, w)[0]; l["leader"] != "alpha" || l["held"] != true || l["term"].(float64) != term {
		t.Errorf("watch's first line: %v, want alpha with term %v", l, term)
	}
	r.signal(syscall.SIGKILL)
	killedAt := time.Now()
	waitFor(t, advisoryTakeover, "watch to show no leader after SIGKILL of the leader", func() bool {
		l := watchLines(t, w)
		return l[len(l)-1]["leader"] == nil && l[len(l)-1]["held"] == false
	})
	t.Logf("advisory strategy: watch saw the killed leader go after %v", time.Since(killedAt).Round(time.Millisecond))
	for _, p := range []*proc{w, early} {
		p.signal(syscall.SIGTERM)
		if code := p.wait(10 * time.Second); code != 0 {
			t.Errorf("watch exit code %d after SIGTERM", code)
		}
	}
	if l := watchLines(t, w); len(l) != 2 || l[1]["term"].(float64) != term {
		t.Errorf("watch printed %v, want alpha then none with term %v", l, term)
	}
	if st, _ := status("adv"); st["leader"] != nil || st["term"].(float64) != term {
		t.Errorf("status after the leader was killed: %v, want no leader and the last term %v", st, term)
	}

	// The other way round: an election of the lease strategy, looked at
	// with --strategy advisory, shows its last term, with a note.
	if _, stderr, code := e.run("run", "--store", store, "--name", "leased", "--", "true"); code != 0 {
		t.Fatalf("run: exit %d\n%s", code, stderr)
	}
	out, stderr, code := e.run("status", "--store", store, "--name", "leased", "--strategy", "advisory")
	if code != 0 || !strings.Contains(out, "none (last term 1)") || !strings.Contains(stderr, "elected with the lease strategy") {
		t.Errorf("status --strategy advisory of a lease election: exit %d\n%s%s", code, out, stderr)
	}
	// An election never elected shows no leader, with either strategy.
	for _, args := range [][]string{nil, {"--strategy", "advisory"}} {
		if st, stderr := status("never", args...); st["leader"] != nil || st["term"].(float64) != 0 || stderr != "" {
			t.Errorf("status %v of an election never elected: %v\n%s", args, st, stderr)
		}
	}
}

// watchLines returns the JSON lines that "leader watch --json" printed.
func watchLines(t *testing.T, w *proc) []map[string]any {
	t.Helper()
	var out []map[string]any
	sc := bufio.NewScanner(strings.NewReader(w.stdout.String()))
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("watch printed a line that is not JSON: %q", sc.Text())
		}
		out = append(out, m)
	}
	return out
}

func checkDemo(t *testing.T, out, stderr string, code int) {
	t.Helper()
	if code != 0 {
		t.Fatalf("demo: exit %d\n%s\n%s", code, out, stderr)
	}
	for _, want := range []string{
		"takeover after SIGKILL of the leader:",
		"handover after SIGTERM to the leader:",
		"the killed leader's command was gone before the next one started: yes",
		"at most one command ran at any moment: yes",
		"SIGKILL -> cand-", "SIGTERM -> cand-", "released the lease",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("demo output lacks %q:\n%s", want, out)
		}
	}
	for _, line := range strings.Split(out, "\n") {
		if strings.Contains(line, "takeover after") || strings.Contains(line, "handover after") {
			t.Log(strings.TrimSpace(line))
		}
	}
}

func TestDemoOnTheEmbeddedStore(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	began := time.Now()
	out, stderr, code := e.run("demo")
	checkDemo(t, out, stderr, code)
	if took := time.Since(began); took > 30*time.Second {
		t.Errorf("the demo took %v, want under 30s", took)
	}
	// It cleaned up: no candidate, and so no command, is left.
	if strings.Contains(out, "!!") {
		t.Errorf("the demo saw two commands at once:\n%s", out)
	}
}
