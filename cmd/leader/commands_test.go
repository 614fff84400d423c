//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// onceConcurrently starts n "leader once" invocations of one job at once;
// the job records each run and blocks until the test lets it finish, so the
// invocations surely overlap. It checks that exactly one ran the job, that
// the others exited 0 with nothing but info lines, and that the winner
// passed the job's exit code (3) through.
func onceConcurrently(t *testing.T, e *env, store string, n int) {
	ranLog := filepath.Join(e.dir, "ran")
	release := filepath.Join(e.dir, "release")
	job := `echo "ran $LEADER_ID $LEADER_TERM $LEADER_HELD" >> "$RAN"; while [ ! -e "$RELEASE" ]; do sleep 0.02; done; exit 3`
	je := e.with("RAN="+ranLog, "RELEASE="+release)
	procs := make([]*proc, n)
	for i := range procs {
		procs[i] = je.start("once", "--store", store, "--name", "nightly", "--window", "1m", "--", "sh", "-c", job)
	}
	waitFor(t, 20*time.Second, "one run to start", func() bool { return lines(t, ranLog) >= 1 })
	// Every other invocation exits 0, with no warning, while the run goes
	// on.
	var winner *proc
	waitFor(t, 20*time.Second, "the other invocations to exit", func() bool {
		exited := 0
		for _, p := range procs {
			if p.exited() {
				exited++
			}
		}
		return exited == n-1
	})
	for _, p := range procs {
		if !p.exited() {
			winner = p
			continue
		}
		if p.code != 0 || p.stdout.String() != "" || !onlyInfo(p.stderr.String()) {
			t.Errorf("a losing invocation exited %d with output %q %q, want 0 and info lines only", p.code, p.stdout.String(), p.stderr.String())
		}
	}
	if err := os.WriteFile(release, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if code := winner.wait(20 * time.Second); code != 3 {
		t.Errorf("the winning invocation exited %d, want the job's 3\n%s", code, winner.stderr.String())
	}
	if runs := lines(t, ranLog); runs != 1 {
		b, _ := os.ReadFile(ranLog)
		t.Errorf("the job ran %d times, want once:\n%s", runs, b)
	}
	b, _ := os.ReadFile(ranLog)
	if f := strings.Fields(string(b)); len(f) != 4 || f[3] != "1" {
		t.Errorf("job environment: %q", b)
	}
}

// onlyInfo reports whether every line of a text log is at info level.
func onlyInfo(log string) bool {
	for line := range strings.Lines(log) {
		if !strings.Contains(line, " level=INFO ") {
			return false
		}
	}
	return true
}

func TestOnceRunsOneOfConcurrentInvocationsOnTheEmbeddedStore(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	onceConcurrently(t, e, e.fileStore(), 5)
}

func TestStatusAndWatch(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	store := e.fileStore()

	// Nothing yet.
	out, stderr, code := e.run("status", "--store", store, "--name", "sw", "--json")
	if code != 0 {
		t.Fatalf("status exit code %d: %s", code, stderr)
	}
	var st map[string]any
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatalf("status --json printed %q: %v", out, err)
	}
	if st["leader"] != nil || st["held"] != false {
		t.Errorf("status of a fresh election: %s", out)
	}

	w := e.start("watch", "--store", store, "--name", "sw", "--json")
	watchLines := func() []map[string]any {
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
	waitFor(t, 20*time.Second, "watch's first line", func() bool { return len(watchLines()) >= 1 })

	r := e.start("run", "--store", store, "--name", "sw", "--id", "alpha", "--", "sleep", "1000")
	waitFor(t, 20*time.Second, "watch to show alpha leading", func() bool {
		l := watchLines()
		return l[len(l)-1]["leader"] == "alpha"
	})

	out, _, code = e.run("status", "--store", store, "--name", "sw", "--json")
	if code != 0 {
		t.Fatalf("status exit code %d", code)
	}
	st = nil
	if err := json.Unmarshal([]byte(out), &st); err != nil || strings.Count(strings.TrimSpace(out), "\n") != 0 {
		t.Fatalf("status --json printed %q, want one JSON object: %v", out, err)
	}
	for _, k := range []string{"name", "leader", "term", "expires_at", "acquired_at", "held"} {
		if _, ok := st[k]; !ok {
			t.Errorf("status --json lacks %q: %s", k, out)
		}
	}
	if st["name"] != "sw" || st["leader"] != "alpha" || st["held"] != true || st["term"].(float64) < 1 || st["expires_at"] == nil {
		t.Errorf("status --json: %s", out)
	}
	if _, err := time.Parse(time.RFC3339Nano, st["expires_at"].(string)); err != nil {
		t.Errorf("expires_at: %v", err)
	}

	text, _, code := e.run("status", "--store", store, "--name", "sw")
	if code != 0 || !strings.Contains(text, "alpha") || !strings.Contains(text, "term") || !strings.Contains(text, "expires") || !strings.Contains(text, "since") {
		t.Errorf("status: exit %d\n%s", code, text)
	}

	r.signal(syscall.SIGTERM)
	if code := r.wait(10 * time.Second); code != 0 {
		t.Errorf("run exit code %d", code)
	}
	waitFor(t, 10*time.Second, "watch to show no leader", func() bool {
		l := watchLines()
		return l[len(l)-1]["leader"] == nil && l[len(l)-1]["held"] == false
	})
	w.signal(syscall.SIGINT)
	if code := w.wait(10 * time.Second); code != 0 {
		t.Errorf("watch exit code %d after SIGINT", code)
	}
	if l := watchLines(); len(l) != 3 {
		t.Errorf("watch printed %d lines, want 3 (none, alpha, none):\n%s", len(l), w.stdout.String())
	}

	// The text form of watch.
	tw := e.start("watch", "--store", store, "--name", "sw")
	waitFor(t, 20*time.Second, "a text line from watch", func() bool { return strings.Contains(tw.stdout.String(), "leader=none") })
	tw.signal(syscall.SIGTERM)
	if code := tw.wait(10 * time.Second); code != 0 {
		t.Errorf("watch exit code %d after SIGTERM", code)
	}
}

func TestUsageErrors(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		args []string
		want string // in stderr
	}{
		{"no subcommand", nil, "Usage"},
		{"unknown subcommand", []string{"frobnicate"}, `unknown command "frobnicate"`},
		{"unknown flag", []string{"run", "--name", "x", "--bogus", "--", "true"}, "--bogus"},
		{"missing name", []string{"run", "--", "true"}, "missing --name"},
		{"missing command", []string{"run", "--name", "x"}, "missing the command"},
		{"missing command after --", []string{"run", "--name", "x", "--"}, "missing the command"},
		{"command without --", []string{"run", "--name", "x", "echo", "hi"}, `put "--" before the command`},
		{"bad restart", []string{"run", "--name", "x", "--restart", "sometimes", "--", "true"}, "--restart"},
		{"bad duration", []string{"run", "--name", "x", "--ttl", "soon", "--", "true"}, "--ttl"},
		{"zero TTL", []string{"run", "--name", "x", "--ttl", "0s", "--", "true"}, "leader run: --ttl must be positive, got 0s"},
		{"zero grace", []string{"run", "--name", "x", "--grace", "0s", "--", "true"}, "leader run: --grace must be positive, got 0s"},
		{"TTL too short", []string{"run", "--name", "x", "--ttl", "100ms", "--", "true"}, "--ttl 100ms must be at least"},
		{"grace too long for TTL", []string{"run", "--name", "x", "--ttl", "15s", "--grace", "10s", "--", "true"}, "--grace 10s is too long for --ttl 15s"},
		{"unknown strategy", []string{"run", "--store", "postgres://u:pw@127.0.0.1:1/db", "--strategy", "paxos", "--name", "x", "--", "true"}, `--strategy "paxos": want lease or advisory`},
		{"strategy on the embedded store", []string{"run", "--store", "file:///nowhere", "--strategy", "advisory", "--name", "x", "--", "true"}, "PostgreSQL stores only"},
		{"strategy on the embedded store for status", []string{"status", "--store", "file:///nowhere", "--strategy", "advisory", "--name", "x"}, "PostgreSQL stores only"},
		{"advisory strategy for once", []string{"once", "--store", "postgres://u:pw@127.0.0.1:1/db", "--strategy", "advisory", "--name", "x", "--", "true"}, "window after a run"},
		{"unknown store scheme", []string{"status", "--store", "mysql://h/db", "--name", "x"}, `unknown scheme "mysql"`},
		{"relative file store", []string{"status", "--store", "file://relative/dir", "--name", "x"}, "file:///path"},
		{"file store in the root directory", []string{"status", "--store", "file:///", "--name", "x"}, "not the root directory"},
		{"bad log format", []string{"status", "--name", "x", "--log-format", "xml"}, "--log-format"},
		{"status without name", []string{"status"}, "missing --name"},
		{"watch without name", []string{"watch"}, "missing --name"},
		{"status with an argument", []string{"status", "--name", "x", "extra"}, `unexpected argument "extra"`},
		{"once without command", []string{"once", "--name", "x"}, "missing the command"},
		{"once window too short", []string{"once", "--name", "x", "--window", "10ms", "--", "true"}, "--window 10ms"},
		{"completion without a shell", []string{"completion"}, "missing the shell: want bash, zsh or fish"},
		{"completion for an unknown shell", []string{"completion", "tcsh"}, `unknown shell "tcsh": want bash, zsh or fish`},
		{"help for an unknown command", []string{"help", "nope"}, `unknown command "nope"`},
		{"bad http address", []string{"run", "--name", "x", "--http", "a:b:c", "--", "true"}, "--http"},
		{"run without a store", []string{"run", "--name", "x", "--", "true"}, "no store named"},
		{"status without a store", []string{"status", "--name", "x"}, "no store named"},
		{"watch without a store", []string{"watch", "--name", "x"}, "no store named"},
		{"migrate without a store", []string{"migrate"}, "no store named"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			_, stderr, code := e.run(tt.args...)
			if want := usageCode(tt.args); code != want {
				t.Errorf("exit code %d, want %d\n%s", code, want, stderr)
			}
			if !strings.Contains(stderr, tt.want) {
				t.Errorf("stderr does not say %q:\n%s", tt.want, stderr)
			}
		})
	}
}

// usageCode is the exit code of a usage error in the command line args:
// 125 for run and once, whose other codes are their command's, else 2.
func usageCode(args []string) int {
	if len(args) > 0 && (args[0] == "run" || args[0] == "once") {
		return exitLeaderError
	}
	return exitUsage
}

// failureCode is the exit code of a runtime error of the command line args:
// 125 for run and once, else 1.
func failureCode(args []string) int {
	if len(args) > 0 && (args[0] == "run" || args[0] == "once") {
		return exitLeaderError
	}
	return exitFailure
}

// Every duration flag of every subcommand refuses zero and negative
// values with a usage error that names the flag, before anything else is
// checked; none takes zero to mean its default.
func TestDurationFlagsMustBePositive(t *testing.T) {
	t.Parallel()
	for _, cmd := range commands {
		if cmd.hidden {
			continue
		}
		cmd.flags().VisitAll(func(f *flag.Flag) {
			if !isDurationFlag(f) {
				return
			}
			for _, value := range []string{"0", "0s", "-1s"} {
				t.Run(cmd.name+" --"+f.Name+" "+value, func(t *testing.T) {
					t.Parallel()
					e := newEnv(t)
					_, stderr, code := e.run(cmd.name, "--"+f.Name, value)
					if want := usageCode([]string{cmd.name}); code != want {
						t.Errorf("exit code %d, want %d\n%s", code, want, stderr)
					}
					d, _ := time.ParseDuration(value)
					want := fmt.Sprintf("leader %s: --%s must be positive, got %v\n", cmd.name, f.Name, d)
					if !strings.HasPrefix(stderr, want) {
						t.Errorf("stderr does not start with %q:\n%s", want, stderr)
					}
				})
			}
		})
	}
}

// The default of every duration flag is positive too, or, where it is
// computed from other flags, described in words.
func TestDurationFlagDefaultsArePositive(t *testing.T) {
	t.Parallel()
	for _, cmd := range commands {
		cmd.flags().VisitAll(func(f *flag.Flag) {
			if !isDurationFlag(f) {
				return
			}
			if d, err := time.ParseDuration(f.DefValue); err == nil && d <= 0 {
				t.Errorf("%s --%s: default %v", cmd.name, f.Name, d)
			}
		})
	}
}

// isDurationFlag tells whether f takes a time.Duration.
func isDurationFlag(f *flag.Flag) bool {
	g, ok := f.Value.(flag.Getter)
	if !ok {
		return false
	}
	_, ok = g.Get().(time.Duration)
	return ok
}

// With --strategy advisory on PostgreSQL, the flags are accepted and the
// store is opened: a server that cannot be reached is a runtime error, as
// with the lease strategy, and the password shows nowhere.
func TestAdvisoryStrategyOnAnUnreachableServerIsARuntimeError(t *testing.T) {
	t.Parallel()
	const secret = "S3cretForAdvisory"
	for _, args := range [][]string{
		{"run", "--name", "x", "--", "true"},
		{"status", "--name", "x"},
		{"watch", "--name", "x"},
	} {
		e := newEnv(t)
		args = append([]string{args[0], "--store", "postgres://u:" + secret + "@127.0.0.1:1/db?connect_timeout=5", "--strategy", "advisory"}, args[1:]...)
		_, stderr, code := e.run(args...)
		if want := failureCode(args); code != want || !strings.Contains(stderr, "connecting to") || strings.Contains(stderr, secret) {
			t.Errorf("%s: exit %d, want %d, a word on connecting and no password:\n%s", args[0], code, want, stderr)
		}
	}
}

func TestHelp(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	out, _, code := e.run("help")
	if code != 0 || !strings.Contains(out, "leader run") || !strings.Contains(out, "Exit codes") {
		t.Errorf("help: exit %d\n%s", code, out)
	}
	for _, cmd := range commands {
		if !cmd.hidden && !strings.Contains(out, "\n  leader "+cmd.name+" ") {
			t.Errorf("help does not list %s", cmd.name)
		}
	}
	for _, cmd := range []string{"run", "once", "status", "watch", "migrate", "demo", "version", "completion"} {
		out, _, code := e.run(cmd, "-h")
		if code != 0 || !strings.Contains(out, "Usage: leader "+cmd) {
			t.Errorf("%s -h: exit %d\n%s", cmd, code, out)
		}
		out2, _, _ := e.run("help", cmd)
		if out2 != out {
			t.Errorf("help %s differs from %s -h", cmd, cmd)
		}
	}
	out, _, _ = e.run("run", "-h")
	for _, want := range []string{"--grace", "--ttl", "--restart", "--http", "--store", "--strategy", "advisory", "PostgreSQL 14", "PgBouncer", "Exit codes", "128+N", "125", "126", "127", "LEADER_TERM"} {
		if !strings.Contains(out, want) {
			t.Errorf("run -h does not mention %s", want)
		}
	}
	out, _, _ = e.run("once", "-h")
	for _, want := range []string{"Exit codes", "125", "126", "127", "LEADER_STORE", "rc -eq 125"} {
		if !strings.Contains(out, want) {
			t.Errorf("once -h does not mention %s", want)
		}
	}
}

func TestMigrateOnTheEmbeddedStoreHasNothingToDo(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	out, _, code := e.run("migrate", "--store", e.fileStore())
	if code != 0 || !strings.Contains(out, "nothing to migrate") {
		t.Errorf("exit %d: %s", code, out)
	}
}

func TestStoreFromTheEnvironment(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	// No --store: LEADER_STORE names it.
	store := e.fileStore()
	if _, stderr, code := e.with("LEADER_STORE="+store).run("run", "--name", "env", "--", "true"); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	out, _, _ := e.run("status", "--store", store, "--name", "env", "--json")
	if !strings.Contains(out, `"term":1`) {
		t.Errorf("the run did not use $LEADER_STORE: %s", out)
	}
}

// TestPasswordsNeverShow runs subcommands against PostgreSQL URLs that fail
// in different ways, and checks that the password appears nowhere.
func TestPasswordsNeverShow(t *testing.T) {
	t.Parallel()
	const secret = "Sup3rS3cretPassw0rd"
	urls := []string{
		"postgres://app:" + secret + "@127.0.0.1:1/db?sslmode=disable&connect_timeout=2", // nothing listens
		"postgresql://app:" + secret + "@127.0.0.1:notaport/db",                          // unparseable
		"postgres://app@127.0.0.1:1/db?password=" + secret + "&sslmode=bogus",            // bad option
	}
	var wg sync.WaitGroup
	for _, u := range urls {
		for _, args := range [][]string{
			{"status", "--name", "x"},
			{"watch", "--name", "x", "--log-format", "json"},
			{"migrate", "--log-level", "debug"},
			{"run", "--name", "x", "--log-level", "debug", "--", "true"},
			{"once", "--name", "x", "--", "true"},
		} {
			wg.Go(func() {
				e := newEnv(t)
				withStore := append([]string{args[0], "--store", u}, args[1:]...)
				out, stderr, code := e.run(withStore...)
				if code == 0 {
					t.Errorf("%v on %s: exit code 0", args, u)
				}
				if strings.Contains(out+stderr, secret) {
					t.Errorf("%v: the password shows:\n%s%s", args, out, stderr)
				}
				if !strings.Contains(stderr, "xxxxx") && !strings.Contains(stderr, "127.0.0.1") {
					t.Errorf("%v: the error does not say which store:\n%s", args, stderr)
				}
			})
		}
	}
	wg.Wait()
}
