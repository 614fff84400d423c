//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/leaderelect/leader/internal/pgtest"
)

// TestPasswordsNeverShowOnAServerThatChecksThem runs the PostgreSQL
// subcommands, with each strategy, on store URLs that carry a password, on
// a server that checks passwords: with a wrong password, before migrate,
// as a role without grants, as a role with only the grants the stores need
// (where migrate fails and the rest works), and through PgBouncer (where
// the advisory strategy is refused). The password must show nowhere in
// what the command prints, at debug level too. TestPasswordsNeverShow
// covers servers that cannot be reached and URLs that do not parse.
func TestPasswordsNeverShowOnAServerThatChecksThem(t *testing.T) {
	t.Parallel()
	cluster := checkingCluster(t)

	// migratedDB returns a fresh database, migrated by the superuser.
	migratedDB := func(t *testing.T, e *env) string {
		t.Helper()
		u := cluster.NewDatabase(t)
		if out, stderr, code := e.run("migrate", "--store", u); code != 0 {
			t.Fatalf("migrate: exit %d\n%s%s", code, out, stderr)
		}
		return u
	}
	// grant gives role what the stores need on the tables of superURL's
	// database.
	grant := func(t *testing.T, superURL, role string) {
		t.Helper()
		pool := pgtest.OpenPool(t, superURL)
		r := pgx.Identifier{role}.Sanitize()
		for _, sql := range []string{
			"GRANT CONNECT ON DATABASE " + pgx.Identifier{pool.Config().ConnConfig.Database}.Sanitize() + " TO " + r,
			"GRANT USAGE ON SCHEMA public TO " + r,
			"GRANT SELECT, INSERT, UPDATE ON public.leader_leases, public.leader_advisory, public.leader_strategies TO " + r,
			"GRANT SELECT, INSERT ON public.leader_leases_epochs TO " + r,
			"GRANT SELECT, INSERT, UPDATE, DELETE ON public.leader_heartbeats TO " + r,
			"GRANT SELECT, INSERT, UPDATE, DELETE ON public.leader_messages TO " + r,
			"GRANT SELECT, INSERT, UPDATE, DELETE ON public.leader_leases_candidates TO " + r,
		} {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			_, err := pool.Exec(ctx, sql)
			cancel()
			if err != nil {
				t.Fatalf("%s: %v", sql, err)
			}
		}
	}

	t.Run("with a wrong password", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		secret, wrong := secretPassword(t), secretPassword(t)
		role := checkedRole(t, cluster, secret)
		store := loginURL(t, migratedDB(t, e), role, wrong)
		for _, r := range runEverySubcommand(t, e, store) {
			r.check(t, secret, wrong)
			if want := failureCode(r.args); r.code != want || !strings.Contains(r.output, "password authentication failed") {
				t.Errorf("%v: exit %d, want %d and a word on the failed password:\n%s", r.args, r.code, want, r.output)
			}
		}
	})

	t.Run("before migrate", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		secret := secretPassword(t)
		store := loginURL(t, cluster.NewDatabase(t), checkedRole(t, cluster, secret), secret)
		for _, r := range runEverySubcommand(t, e, store) {
			r.check(t, secret)
			if want := failureCode(r.args); r.code != want {
				t.Errorf("%v: exit %d, want %d:\n%s", r.args, r.code, want, r.output)
			}
		}
	})

	t.Run("as a role without grants", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		secret := secretPassword(t)
		store := loginURL(t, migratedDB(t, e), checkedRole(t, cluster, secret), secret)
		for _, r := range runEverySubcommand(t, e, store) {
			r.check(t, secret)
			// Migrate finds the schema up to date, which needs no
			// privilege ("before migrate" sees it refused).
			if r.args[0] == "migrate" {
				if r.code != 0 {
					t.Errorf("%v: exit %d, want 0 (the schema is up to date):\n%s", r.args, r.code, r.output)
				}
				continue
			}
			if !strings.Contains(r.output, "permission denied") {
				t.Errorf("%v: exit %d, and no word on the permission denied:\n%s", r.args, r.code, r.output)
			}
		}
	})

	t.Run("as a role with the stores' grants only", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		secret := secretPassword(t)
		superURL := migratedDB(t, e)
		role := checkedRole(t, cluster, secret)
		grant(t, superURL, role)
		for _, r := range runEverySubcommand(t, e, loginURL(t, superURL, role, secret)) {
			r.check(t, secret)
			// Migrate too: it finds the schema up to date, which needs
			// no right to create in schema public.
			if r.code != 0 {
				t.Errorf("%v: exit %d, want 0:\n%s", r.args, r.code, r.output)
			}
		}
	})

	t.Run("through PgBouncer in transaction mode", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		secret := secretPassword(t)
		superURL := migratedDB(t, e)
		role := checkedRole(t, cluster, secret)
		grant(t, superURL, role)
		// PgBouncer logs in to the server with the role's password; its
		// clients need none, but this URL carries it, as one written for
		// a direct connection would.
		bouncer := loginURL(t, pgtest.PgBouncer(t, loginURL(t, superURL, role, secret), "transaction"), role, secret)
		for _, r := range runEverySubcommand(t, e, bouncer) {
			r.check(t, secret)
			switch {
			case r.strategy == "advisory":
				if want := usageCode(r.args); r.code != want || !strings.Contains(r.output, "PgBouncer") {
					t.Errorf("%v: exit %d, want %d and a word on PgBouncer:\n%s", r.args, r.code, want, r.output)
				}
			case r.code != 0: // the lease strategy works through PgBouncer, and migrate finds the schema up to date
				t.Errorf("%v: exit %d, want 0:\n%s", r.args, r.code, r.output)
			}
		}
	})
}

// subcommandRun is what one subcommand printed, and how it ended.
type subcommandRun struct {
	args     []string
	strategy string // "" for migrate and once, which have no --strategy here
	output   string // stdout and stderr
	code     int
}

// check fails t if r printed nothing, or printed one of secrets.
func (r subcommandRun) check(t *testing.T, secrets ...string) {
	t.Helper()
	if strings.TrimSpace(r.output) == "" {
		t.Errorf("%v printed nothing", r.args)
	}
	for _, s := range secrets {
		if strings.Contains(r.output, s) {
			t.Errorf("%v shows the password %q:\n%s", r.args, s, r.output)
		}
	}
}

// runEverySubcommand runs, at once, every subcommand that talks to the
// store, with each strategy where it has one (on an election of its own:
// one election has one strategy), at debug level where it logs, and
// returns what each printed. watch, which never exits by itself, is
// stopped with SIGTERM once it has shown the lease and run for a few
// seconds (see briefly).
func runEverySubcommand(t *testing.T, e *env, store string) []subcommandRun {
	t.Helper()
	var runs []subcommandRun
	for _, strategy := range []string{"lease", "advisory"} {
		name := "pw-" + strategy
		for _, args := range [][]string{
			{"status", "--name", name},
			{"status", "--name", name, "--json"},
			{"watch", "--name", name, "--json", "--log-level", "debug"},
			{"run", "--name", name, "--log-level", "debug", "--", "true"},
		} {
			args = append([]string{args[0], "--store", store, "--strategy", strategy}, args[1:]...)
			runs = append(runs, subcommandRun{args: args, strategy: strategy})
		}
	}
	for _, args := range [][]string{
		{"migrate", "--store", store, "--log-level", "debug"},
		{"once", "--store", store, "--name", "pw-once", "--log-level", "debug", "--", "true"},
	} {
		runs = append(runs, subcommandRun{args: args})
	}
	var wg sync.WaitGroup
	for i := range runs {
		wg.Go(func() {
			runs[i].output, runs[i].code = e.briefly(runs[i].args...)
		})
	}
	wg.Wait()
	return runs
}

// briefly runs the leader binary with args until it exits, and returns
// what it printed (stdout, then stderr) and its exit code. Every
// subcommand but watch exits by itself, and gets a minute before it is
// sent SIGTERM: ten of them start at once, each logging in with SCRAM,
// beside the rest of the suite on a busy machine (three seconds were not
// always enough). watch, which exits by itself only on an error, is sent
// SIGTERM once it has shown the lease (so it got past logging in) and run
// for three seconds, or after a minute.
func (e *env) briefly(args ...string) (output string, code int) {
	p := e.start(args...)
	start := time.Now()
	stop := func() bool {
		switch {
		case time.Since(start) >= time.Minute:
			return true
		case args[0] == "watch":
			return time.Since(start) >= 3*time.Second && p.stdout.String() != ""
		}
		return false
	}
	for !p.exited() && !stop() {
		time.Sleep(20 * time.Millisecond) // poll interval
	}
	if !p.exited() {
		_ = p.cmd.Process.Signal(syscall.SIGTERM) // it may have exited since
	}
	code = p.wait(30 * time.Second)
	return p.stdout.String() + p.stderr.String(), code
}

// secretPassword returns a password that shows up nowhere by chance.
func secretPassword(t *testing.T) string {
	t.Helper()
	b := make([]byte, 8)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return "pw-" + hex.EncodeToString(b) + "-secret"
}

// checkedRole creates a login role with password, and no privileges
// beyond PUBLIC's, on cluster, and returns its name.
func checkedRole(t *testing.T, cluster *pgtest.Cluster, password string) string {
	t.Helper()
	name := "leader_app_" + strings.TrimPrefix(strings.TrimSuffix(secretPassword(t), "-secret"), "pw-")
	cluster.Exec(t, "CREATE ROLE "+name+" LOGIN PASSWORD '"+password+"' NOSUPERUSER NOCREATEDB NOCREATEROLE")
	return name
}

// loginURL returns the connection URL raw with its user and password
// replaced.
func loginURL(t *testing.T, raw, user, password string) string {
	t.Helper()
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword(user, password)
	return u.String()
}

// checkingCluster starts a private cluster that, unlike the shared one
// (initdb -A trust), checks passwords: every role but the superuser logs
// in over 127.0.0.1 with SCRAM. The superuser rewrites pg_hba.conf (COPY
// to a server file) and reloads it.
func checkingCluster(t *testing.T) *pgtest.Cluster {
	t.Helper()
	c := pgtest.NewCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var superuser, hbaFile string
	if err := c.Admin(t).QueryRow(ctx, "SELECT current_user, current_setting('hba_file')").Scan(&superuser, &hbaFile); err != nil {
		t.Fatal(err)
	}
	rules := []string{
		"local all all trust",
		"host all " + superuser + " 127.0.0.1/32 trust",
		"host all all 127.0.0.1/32 scram-sha-256",
	}
	var values []string
	for i, rule := range rules {
		values = append(values, fmt.Sprintf("(%d, '%s')", i, rule))
	}
	c.Exec(t, "COPY (SELECT rule FROM (VALUES "+strings.Join(values, ", ")+") AS v(n, rule) ORDER BY n) TO '"+
		strings.ReplaceAll(hbaFile, "'", "''")+"'")
	c.Exec(t, "SELECT pg_reload_conf()")
	// The postmaster reloads in the background: wait until a wrong
	// password is refused.
	probe := loginURL(t, c.NewDatabase(t), checkedRole(t, c, secretPassword(t)), "wrong")
	waitFor(t, 20*time.Second, "the server to check passwords", func() bool {
		conn, err := pgx.Connect(ctx, probe)
		if err == nil {
			_ = conn.Close(ctx)
			return false
		}
		var pgErr *pgconn.PgError
		return errors.As(err, &pgErr) && pgErr.Code == "28P01" // invalid_password
	})
	return c
}
