//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"net/url"
	"os"
	"path/filepath"
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

	// migrated returns a fresh database's URL, migrated with "leader migrate".
	migrated := func(t *testing.T, e *env) string {
		t.Helper()
		u := pgtest.NewDatabase(t)
		out, stderr, code := e.run("migrate", "--store", u)
		if code != 0 || !strings.Contains(out, "up to date") {
			t.Fatalf("migrate: exit %d\n%s%s", code, out, stderr)
		}
		return u
	}

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

	t.Run("three candidates: one child, SIGKILL takeover, SIGTERM handover", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		u := migrated(t, e)
		failover(t, e, u, "2s", 20*time.Second, time.Second)
	})

	t.Run("a frozen leader's command is stopped before the lease passes on", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		frozenLeader(t, e, migrated(t, e))
	})

	t.Run("once runs one of concurrent invocations and keeps the window after the run", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		u := migrated(t, e)
		onceConcurrently(t, e, u, 4)
		// A firing within the window after the run finds it taken.
		ran := filepath.Join(e.dir, "late")
		out, stderr, code := e.run("once", "--store", u, "--name", "nightly", "--window", "1m", "--", "sh", "-c", "touch "+ran)
		if code != 0 || out != "" || stderr != "" {
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
