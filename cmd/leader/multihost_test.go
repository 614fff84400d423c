//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"encoding/json"
	"net"
	"net/url"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/leaderelect/leader/cmd/leader/internal/redact"
	"github.com/leaderelect/leader/internal/pgtest"
)

// multiHostURL returns a store URL that names the hosts of the connection
// URLs servers, in their order, with the first one's user and database,
// password (unless it is ""), and target_session_attrs=read-write, as an
// HA setup gives: a client connects to the first host that accepts
// writes.
func multiHostURL(t *testing.T, password string, servers ...string) string {
	t.Helper()
	var (
		out   *url.URL
		hosts []string
	)
	for _, s := range servers {
		u, err := url.Parse(s)
		if err != nil {
			t.Fatal(err)
		}
		if out == nil {
			out = u
		}
		hosts = append(hosts, u.Host)
	}
	out.Host = strings.Join(hosts, ",")
	if password != "" {
		out.User = url.UserPassword(out.User.Username(), password) // the test servers trust every login
	}
	q := out.Query()
	q.Set("target_session_attrs", "read-write")
	out.RawQuery = q.Encode()
	return out.String()
}

// blackHole returns the connection URL like with its host replaced by a
// listener that never answers: the kernel accepts connections to it, and
// nothing is ever read or sent, as with a host that vanished behind a
// firewall that drops its packets.
func blackHole(t *testing.T, like string) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	u, err := url.Parse(like)
	if err != nil {
		t.Fatal(err)
	}
	u.Host = l.Addr().String()
	return u.String()
}

// TestMultiHostStoreURL runs every subcommand that takes a store on a
// multi-host URL that names a streaming standby before its primary, with
// target_session_attrs=read-write and a password. Migrate must reach the
// primary (the standby refuses writes); then replication is cut, so that
// what the subcommands write is on the primary alone: the standby, which a
// subcommand that read from it would see, shows no election. Each
// subcommand exits 0 and shows the password nowhere, at debug level too;
// run and once run their commands and log the store with the password
// masked; status, watch and transfer see the leaders that run elected;
// demo runs its failover. Migrate and status also pass over a host
// listed first that never answers (after its connect timeout).
func TestMultiHostStoreURL(t *testing.T) {
	t.Parallel()
	c := pgtest.NewReplicatedCluster(t, pgtest.ReplicationOptions{})
	secret := secretPassword(t)
	store := multiHostURL(t, secret, c.Standby(), c.Primary())
	masked := redact.URL(store)
	if strings.Contains(masked, secret) || !strings.Contains(masked, ",") {
		t.Fatalf("the masked multi-host URL %s", masked)
	}
	// leader runs "leader cmd --store storeURL args..." and returns its
	// output, failing t unless it
	// exits 0 without showing the password.
	leader := func(t *testing.T, e *env, storeURL, cmd string, args ...string) (stdout, stderr string) {
		t.Helper()
		stdout, stderr, code := e.run(append([]string{cmd, "--store", storeURL}, args...)...)
		(subcommandRun{args: []string{cmd}, output: stdout + stderr}).check(t, secret)
		if code != 0 {
			t.Fatalf("%s %v: exit %d, want 0\n%s%s", cmd, args, code, stdout, stderr)
		}
		return stdout, stderr
	}
	// status returns what "leader status --json" says of election name.
	status := func(t *testing.T, e *env, storeURL, name string) statusJSON {
		t.Helper()
		out, _ := leader(t, e, storeURL, "status", "--name", name, "--json")
		var st statusJSON
		if err := json.Unmarshal([]byte(out), &st); err != nil {
			t.Fatalf("status --json: %v\n%s", err, out)
		}
		return st
	}

	if out, _ := leader(t, newEnv(t), store, "migrate", "--log-level", "debug"); !strings.Contains(out, "up to date") || !strings.Contains(out, masked) {
		t.Fatalf("migrate does not say that the schema on %s is up to date:\n%s", masked, out)
	}
	c.WaitReplayed(t) // the standby has the tables, and no election
	c.CutReplication()

	t.Run("run and once run their commands as elected on the primary, and log the store masked", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		elections := map[string][]string{
			"ran-lease":    {"run", "--strategy", strategyLease},
			"ran-advisory": {"run", "--strategy", strategyAdvisory},
			"once":         {"once"},
		}
		for name, args := range elections {
			out, stderr := leader(t, e, store, args[0], append(args[1:], "--name", name, "--log-level", "debug", "--", "sh", "-c", `echo "term $LEADER_TERM"`)...)
			if out != "term 1\n" || !strings.Contains(stderr, `store="`+masked+`"`) {
				t.Errorf("%v: printed %q, want term 1; or it does not log the store as %s\n%s", args, out, masked, stderr)
			}
			if st := status(t, e, store, name); st.Term != 1 || st.Held != (args[0] == "once") {
				t.Errorf("status of %s after %v: %+v, want term 1, held only after once (for its window)", name, args, st)
			}
			// The standby, cut off, has no election: status read the
			// primary.
			if st := status(t, e, c.Standby(), name); st.Term != 0 {
				t.Errorf("status of %s on the standby: %+v, want no election", name, st)
			}
		}
	})

	t.Run("migrate and status pass over a host listed first that never answers", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		for _, strategy := range []string{strategyLease, strategyAdvisory} {
			leader(t, e, store, "run", "--strategy", strategy, "--name", "silent-"+strategy, "--", "true")
		}
		silent := multiHostURL(t, secret, blackHole(t, c.Primary()), c.Standby(), c.Primary())
		t.Run("migrate", func(t *testing.T) {
			t.Parallel()
			if out, _ := leader(t, e, silent, "migrate"); !strings.Contains(out, "up to date") {
				t.Errorf("migrate does not say that the schema is up to date:\n%s", out)
			}
		})
		// The advisory strategy's status connects a session of its own.
		for _, strategy := range []string{strategyLease, strategyAdvisory} {
			t.Run("status of a "+strategy+" election", func(t *testing.T) {
				t.Parallel()
				began := time.Now()
				st := status(t, e, silent, "silent-"+strategy)
				t.Logf("status took %v", time.Since(began).Round(time.Millisecond))
				if st.Term != 1 {
					t.Errorf("status: %+v, want term 1", st)
				}
			})
		}
	})

	for _, strategy := range []string{strategyLease, strategyAdvisory} {
		// candidate starts "leader run --id id" in election name with this
		// strategy.
		candidate := func(e *env, name, id string) *proc {
			return e.start("run", "--store", store, "--name", name, "--id", id, "--strategy", strategy, "--ttl", "3s", "--", "sleep", "1000")
		}
		// stop stops p with SIGTERM and fails t unless it exits 0 without
		// having shown the password.
		stop := func(t *testing.T, p *proc) {
			t.Helper()
			p.signal(syscall.SIGTERM)
			code := p.wait(20 * time.Second)
			(subcommandRun{args: p.cmd.Args[1:2], output: p.stdout.String() + p.stderr.String()}).check(t, secret)
			if code != 0 {
				t.Errorf("%s, stopped by SIGTERM, exited %d, want 0", p.cmd.Args[1], code)
			}
		}

		t.Run("status and watch show a "+strategy+" leader", func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			name := "watched-" + strategy
			w := e.start("watch", "--store", store, "--name", name, "--json", "--log-level", "debug")
			latest := func() map[string]any {
				l := watchLines(t, w)
				if len(l) == 0 {
					return nil
				}
				return l[len(l)-1]
			}
			waitFor(t, 20*time.Second, "watch's first line", func() bool { return latest() != nil })
			r := candidate(e, name, "watched")
			waitFor(t, 20*time.Second, "watch to show the leader", func() bool { return latest()["leader"] == "watched" })
			if st := status(t, e, store, name); st.Leader == nil || *st.Leader != "watched" || !st.Held || st.Term != 1 {
				t.Errorf("status while run leads: %+v, want watched leading with term 1", st)
			}
			stop(t, r)
			waitFor(t, 20*time.Second, "watch to show the leader gone", func() bool { return latest()["held"] == false })
			stop(t, w)
		})

		t.Run("transfer hands a "+strategy+" election over", func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			name := "handed-" + strategy
			from := candidate(e, name, "from")
			waitFor(t, 20*time.Second, "from to lead", func() bool {
				st := status(t, e, store, name)
				return st.Leader != nil && *st.Leader == "from"
			})
			to := candidate(e, name, "to")
			waitFor(t, 20*time.Second, "to to campaign", func() bool { return strings.Contains(to.stderr.String(), "msg=campaigning") })
			time.Sleep(time.Second) // for its first enlistment
			out, stderr, code := e.run("transfer", "--store", store, "--name", name, "--to", "to")
			(subcommandRun{args: []string{"transfer"}, output: out + stderr}).check(t, secret)
			switch {
			case code == exitFailure && strings.Contains(stderr, "cannot hand a lease over"):
				// A store without transfers says so, having found the
				// leader on the primary.
				t.Logf("the store cannot hand a lease over: %s", strings.TrimSpace(stderr))
			case code != 0 || !strings.Contains(out, `from handed election "`+name+`" over to to`):
				t.Errorf("transfer: exit %d\n%s%s", code, out, stderr)
			default:
				if st := status(t, e, store, name); st.Leader == nil || *st.Leader != "to" {
					t.Errorf("status after the transfer: %+v, want to leading", st)
				}
			}
			stop(t, from)
			stop(t, to)
		})

		t.Run("demo, "+strategy+" strategy", func(t *testing.T) {
			t.Parallel()
			out, stderr, code := newEnv(t).run("demo", "--store", store, "--strategy", strategy)
			checkDemo(t, out, stderr, code)
			(subcommandRun{args: []string{"demo"}, output: out + stderr}).check(t, secret)
			if !strings.Contains(out, "store "+masked) {
				t.Errorf("demo does not show the store as %s:\n%s", masked, out)
			}
		})
	}
}
