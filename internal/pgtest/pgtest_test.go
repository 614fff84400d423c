package pgtest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

func TestMain(m *testing.M) { Main(m) }

func TestSharedServerAnswers(t *testing.T) {
	t.Parallel()
	pool := NewPool(t)
	var version string
	if err := pool.QueryRow(context.Background(), "SHOW server_version").Scan(&version); err != nil {
		t.Fatal(err)
	}
	t.Logf("server version %s at %q", version, Shared(t).Addr())
}

func TestEachDatabaseIsFreshAndIsolated(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	a, b := NewPool(t), NewPool(t)
	if a.Config().ConnConfig.Database == b.Config().ConnConfig.Database {
		t.Fatalf("both pools use database %q", a.Config().ConnConfig.Database)
	}
	if _, err := a.Exec(ctx, "CREATE TABLE only_in_a (x int)"); err != nil {
		t.Fatal(err)
	}
	var found bool
	if err := b.QueryRow(ctx, "SELECT to_regclass('only_in_a') IS NOT NULL").Scan(&found); err != nil {
		t.Fatal(err)
	}
	if found {
		t.Fatal("a table created in one test database is visible in another")
	}
}

func TestPrivateClusterRestarts(t *testing.T) {
	t.Parallel()
	c := NewCluster(t)
	pool := c.NewPool(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, "CREATE TABLE kept (x int); INSERT INTO kept VALUES (42)"); err != nil {
		t.Fatal(err)
	}
	c.Stop(t)
	if err := pool.Ping(ctx); err == nil {
		t.Fatal("ping succeeded while the server was stopped")
	}
	c.Start(t)
	// The pool may hand out a connection that died with the old server
	// once; poll until a query succeeds.
	deadline := time.Now().Add(30 * time.Second)
	var x int
	for {
		err := pool.QueryRow(ctx, "SELECT x FROM kept").Scan(&x)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no answer after restart: %v", err)
		}
		time.Sleep(10 * time.Millisecond) // poll interval
	}
	if x != 42 {
		t.Fatalf("after restart read %d, want 42", x)
	}
}

func TestPrivateClusterRecoversFromACrash(t *testing.T) {
	t.Parallel()
	for _, crash := range []struct {
		name string
		do   func(*Cluster, testing.TB)
	}{
		{"immediate shutdown", (*Cluster).StopImmediate},
		{"postmaster killed", (*Cluster).Kill},
	} {
		t.Run(crash.name, func(t *testing.T) {
			t.Parallel()
			c := NewCluster(t)
			pool := c.NewPool(t)
			ctx := context.Background()
			if _, err := pool.Exec(ctx, "CREATE TABLE kept (x int); INSERT INTO kept VALUES (42)"); err != nil {
				t.Fatal(err)
			}
			// The checkpoint, after the commit, makes the row durable
			// whatever synchronous_commit says.
			if _, err := pool.Exec(ctx, "CHECKPOINT"); err != nil {
				t.Fatal(err)
			}
			crash.do(c, t)
			if err := pool.Ping(ctx); err == nil {
				t.Fatal("ping succeeded after the crash")
			}
			c.Start(t)
			deadline := time.Now().Add(30 * time.Second)
			var x int
			for {
				err := pool.QueryRow(ctx, "SELECT x FROM kept").Scan(&x)
				if err == nil {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("no answer after restart: %v", err)
				}
				time.Sleep(10 * time.Millisecond) // poll interval
			}
			if x != 42 {
				t.Fatalf("after restart read %d, want 42", x)
			}
		})
	}
}

func TestDatabaseNameIsValidAndUnique(t *testing.T) {
	t.Parallel()
	long := "TestSomething/with spaces and ÜNICODE/" + string(make([]byte, 100))
	a, b := databaseName(long), databaseName(long)
	if a == b {
		t.Fatalf("two calls gave the same name %q", a)
	}
	if len(a) > 63 {
		t.Fatalf("name %q is %d bytes, over PostgreSQL's 63", a, len(a))
	}
	if got := (pgx.Identifier{a}).Sanitize(); got != `"`+a+`"` {
		t.Fatalf("name %q needs escaping: %s", a, got)
	}
}

func TestWithDatabase(t *testing.T) {
	t.Parallel()
	cases := []struct{ in, want string }{
		{"postgres://u:p@h:5/postgres?sslmode=disable", "postgres://u:p@h:5/db1?sslmode=disable"},
		{"postgresql://h/", "postgresql://h/db1"},
		{"host=h dbname=postgres", "host=h dbname=postgres dbname=db1"},
	}
	for _, tc := range cases {
		got, err := withDatabase(tc.in, "db1")
		if err != nil || got != tc.want {
			t.Errorf("withDatabase(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
		}
		cfg, err := pgx.ParseConfig(got)
		if err != nil || cfg.Database != "db1" {
			t.Errorf("withDatabase(%q) = %q parses to database %v, %v", tc.in, got, cfg, err)
		}
	}
}

// TestClusterIsRemovedWhenTheBinaryCrashes runs this test binary again as a
// child that starts a cluster and panics, and checks that the watchdog stops
// the server and removes its files.
func TestClusterIsRemovedWhenTheBinaryCrashes(t *testing.T) {
	if os.Getenv("PGTEST_CRASH_CHILD") == "1" {
		c := NewCluster(t)
		fmt.Printf("cluster addr=%s dir=%s\n", c.Addr(), c.local.rootDir)
		panic("deliberate crash with a cluster running")
	}
	t.Parallel()
	cmd := exec.Command(os.Args[0], "-test.run=^TestClusterIsRemovedWhenTheBinaryCrashes$", "-test.count=1")
	cmd.Env = append(os.Environ(), "PGTEST_CRASH_CHILD=1")
	out, err := cmd.CombinedOutput()
	if err == nil {
		t.Fatalf("child did not crash:\n%s", out)
	}
	m := regexp.MustCompile(`cluster addr=(\S+) dir=(\S+)`).FindSubmatch(out)
	if m == nil {
		t.Fatalf("child printed no cluster:\n%s", out)
	}
	addr, dir := string(m[1]), string(m[2])
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, statErr := os.Stat(dir)
		conn, dialErr := net.DialTimeout("tcp", addr, time.Second)
		if conn != nil {
			conn.Close()
		}
		if os.IsNotExist(statErr) && dialErr != nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("30s after the crash: server at %s dial error %v, directory %s stat error %v", addr, dialErr, dir, statErr)
		}
		time.Sleep(20 * time.Millisecond) // poll interval
	}
}

func TestFindBinDir(t *testing.T) {
	// Not parallel: it changes PATH.
	root := t.TempDir()
	t.Setenv("PATH", t.TempDir()) // no initdb, no pg_config
	glob := filepath.Join(root, "*", "bin")

	_, err := findBinDirIn(glob)
	if err == nil {
		t.Fatal("found server binaries in an empty directory")
	}
	for _, want := range []string{"PATH", "pg_config", glob, EnvDatabaseURL} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}

	for _, version := range []string{"9.6", "15", "10", "16"} {
		dir := filepath.Join(root, version, "bin")
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		for _, name := range serverBinaries {
			if version == "16" && name == "postgres" {
				continue // an incomplete install is passed over
			}
			if err := os.WriteFile(filepath.Join(dir, name), nil, 0o755); err != nil {
				t.Fatal(err)
			}
		}
	}
	got, err := findBinDirIn(glob)
	if want := filepath.Join(root, "15", "bin"); err != nil || got != want {
		t.Fatalf("findBinDirIn = %q, %v; want the newest complete version %q", got, err, want)
	}
}
