// Package pgtest gives tests a real PostgreSQL server: a throwaway cluster
// started from the installed server binaries, or the server named by the
// environment variable LEADER_TEST_DATABASE_URL.
//
// A test binary that uses pgtest calls Main from its TestMain:
//
//	func TestMain(m *testing.M) { pgtest.Main(m) }
//
// The first test that asks for a database starts one cluster for the whole
// binary (initdb into a temporary directory, a random free port on
// 127.0.0.1, fsync off); Main stops it and removes its files when the tests
// end, then fails the binary if goroutines leaked. Every call to NewDatabase
// or NewPool creates a fresh database with a unique name, so tests that use
// t.Parallel do not see each other's tables.
//
// Tests that stop or restart the server use a private cluster from
// NewCluster, so that they do not disturb the tests running beside them.
// Tests of a failover use NewReplicatedCluster: a private primary with a
// streaming standby, whose replication, and whose clients' connections to
// the primary, pass through proxies the test can cut or black-hole, and
// whose standby the test can promote.
//
// When the binary dies without returning from Main (a panic, a test
// timeout, a kill), a small watchdog process notices that its pipe from the
// test binary closed, stops the cluster and removes its files.
//
// When the test binary runs as root, the server runs as the "postgres"
// operating-system user, as PostgreSQL refuses to run as root. When no
// server binaries are found and LEADER_TEST_DATABASE_URL is not set, tests
// fail with an error that says where pgtest looked; they never skip.
package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"
)

// EnvDatabaseURL names the environment variable that points the tests at an
// existing server instead of a throwaway cluster. Its value is a connection
// string for a superuser (or a role that may create databases) on a
// maintenance database, for example
// postgres://postgres@localhost:5432/postgres?sslmode=disable.
const EnvDatabaseURL = "LEADER_TEST_DATABASE_URL"

// shared is the binary's one shared cluster. It is package state because it
// lives exactly as long as the test binary (between Main's start and end).
var shared struct {
	mu      sync.Mutex
	main    bool     // Main is running
	cluster *Cluster // started on first use
	err     error    // why the shared cluster could not start
}

// Main runs the package's tests with m. It stops the shared cluster when they
// end, even if they failed, and then, if they passed, fails the binary if
// goroutines are still running that the tests started (goleak). Call it from
// TestMain; it does not return.
func Main(m *testing.M) { os.Exit(Run(m)) }

// Run is Main for a TestMain with work of its own to do afterwards: it
// returns the exit code instead of exiting. m is a *testing.M, or a
// wrapper of one whose Run also stops what the TestMain itself started, so
// that it is not taken for a leak. ignore is passed to goleak: for
// goroutines of a test dependency that the package's tests cannot stop.
func Run(m interface{ Run() int }, ignore ...goleak.Option) (code int) {
	shared.mu.Lock()
	shared.main = true
	shared.mu.Unlock()

	code = m.Run()

	shared.mu.Lock()
	c := shared.cluster
	shared.cluster = nil
	shared.main = false
	shared.mu.Unlock()
	if c != nil {
		if err := c.close(); err != nil {
			fmt.Fprintf(os.Stderr, "pgtest: stopping the cluster: %v\n", err)
			if code == 0 {
				code = 1
			}
		}
	}
	if code == 0 {
		if err := goleak.Find(ignore...); err != nil {
			fmt.Fprintf(os.Stderr, "pgtest: goroutines leaked by the tests: %v\n", err)
			code = 1
		}
	}
	return code
}

// Shared returns the test binary's shared server, starting it on first use:
// the server named by LEADER_TEST_DATABASE_URL when it is set, a throwaway
// cluster otherwise. It fails t if the server cannot be had, or if the binary's
// TestMain does not call Main. The shared server cannot be stopped; use
// NewCluster for that.
func Shared(t testing.TB) *Cluster {
	t.Helper()
	c, err := sharedCluster()
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func sharedCluster() (*Cluster, error) {
	shared.mu.Lock()
	defer shared.mu.Unlock()
	if !shared.main {
		return nil, errors.New("pgtest: the test binary must call pgtest.Main from TestMain (it stops the cluster and checks for leaked goroutines)")
	}
	if shared.cluster == nil && shared.err == nil {
		if u := os.Getenv(EnvDatabaseURL); u != "" {
			shared.cluster, shared.err = newExternal(u)
		} else {
			shared.cluster, shared.err = startLocal()
		}
		if shared.cluster != nil {
			shared.cluster.shared = true
		}
	}
	return shared.cluster, shared.err
}

// CreateDatabase creates a fresh database on the shared server and returns
// a connection string for it, for code that has no testing.TB, such as
// Example functions. The binary's TestMain must call Main. The database
// lasts until the binary ends (Main drops it from an external server; a
// throwaway cluster is removed whole).
func CreateDatabase(ctx context.Context) (connString string, err error) {
	c, err := sharedCluster()
	if err != nil {
		return "", err
	}
	connString, err = c.createDatabase(ctx, "example")
	if err == nil && c.external {
		c.mu.Lock()
		c.dropAtClose = append(c.dropAtClose, connString)
		c.mu.Unlock()
	}
	return connString, err
}

// NewDatabase creates a fresh, empty database on the shared server and returns
// a connection string for it. See Cluster.NewDatabase.
func NewDatabase(t testing.TB) (connString string) {
	t.Helper()
	return Shared(t).NewDatabase(t)
}

// NewPool creates a fresh database on the shared server and returns a pool
// connected to it, closed when t ends. See Cluster.NewPool.
func NewPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	return Shared(t).NewPool(t)
}

// OpenPool returns a pool for connString, closed when t ends. It connects
// lazily: an unreachable server shows up at first use, not here.
func OpenPool(t testing.TB, connString string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(connString)
	if err != nil {
		t.Fatalf("pgtest: parsing connection string: %v", err)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("pgtest: opening pool: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// Cluster is a PostgreSQL server for tests: the shared one (Shared) or a
// private one (NewCluster). Its methods are safe for concurrent use.
type Cluster struct {
	shared   bool
	external bool   // named by LEADER_TEST_DATABASE_URL; never started or stopped here
	adminURL string // superuser on the maintenance database
	local    *localServer

	mu          sync.Mutex
	admin       *pgxpool.Pool // opened on first use
	dropAtClose []string      // databases made by CreateDatabase on an external server
}

// NewCluster starts a private throwaway cluster for t, stopped and removed
// when t ends. Use it for tests that stop or restart the server. It always
// starts one from the installed binaries, even when LEADER_TEST_DATABASE_URL
// is set, and fails t if it cannot.
func NewCluster(t testing.TB) *Cluster {
	t.Helper()
	c, err := startLocal()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.close(); err != nil {
			t.Errorf("pgtest: stopping private cluster: %v", err)
		}
	})
	return c
}

func newExternal(adminURL string) (*Cluster, error) {
	if _, err := pgx.ParseConfig(adminURL); err != nil {
		return nil, fmt.Errorf("pgtest: %s: %w", EnvDatabaseURL, err)
	}
	return &Cluster{external: true, adminURL: adminURL}, nil
}

func startLocal() (*Cluster, error) {
	s, err := startServer()
	if err != nil {
		return nil, err
	}
	return &Cluster{local: s, adminURL: s.connString("postgres")}, nil
}

// Addr returns the server's address as host:port ("127.0.0.1:port" for a
// throwaway cluster), for tests that put a proxy in front of it. It is ""
// for an external server.
func (c *Cluster) Addr() string {
	if c.local == nil {
		return ""
	}
	return c.local.addr()
}

// Admin returns a superuser pool on the cluster's maintenance database,
// for statements such as ALTER DATABASE or pg_terminate_backend. The cluster
// owns it: do not close it.
func (c *Cluster) Admin(t testing.TB) *pgxpool.Pool {
	t.Helper()
	pool, err := c.adminPool()
	if err != nil {
		t.Fatal(err)
	}
	return pool
}

func (c *Cluster) adminPool() (*pgxpool.Pool, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.admin == nil {
		pool, err := pgxpool.New(context.Background(), c.adminURL)
		if err != nil {
			return nil, fmt.Errorf("pgtest: opening admin pool: %w", err)
		}
		c.admin = pool
	}
	return c.admin, nil
}

// Exec runs sql with args as superuser on the maintenance database and fails
// t if it fails.
func (c *Cluster) Exec(t testing.TB, sql string, args ...any) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := c.Admin(t).Exec(ctx, sql, args...); err != nil {
		t.Fatalf("pgtest: %s: %v", sql, err)
	}
}

// NewDatabase creates a fresh, empty database with a unique name derived from
// t.Name() and returns a connection string for it. On an external server the
// database is dropped when t ends; a throwaway cluster is removed whole.
func (c *Cluster) NewDatabase(t testing.TB) (connString string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	connString, err := c.createDatabase(ctx, t.Name())
	if err != nil {
		t.Fatal(err)
	}
	if c.external {
		t.Cleanup(func() {
			if err := c.dropDatabase(connString); err != nil {
				t.Logf("pgtest: %v", err)
			}
		})
	}
	return connString
}

// createDatabase creates a database with a unique name derived from hint.
func (c *Cluster) createDatabase(ctx context.Context, hint string) (connString string, err error) {
	name := databaseName(hint)
	admin, err := c.adminPool()
	if err != nil {
		return "", err
	}
	// template0 is never connected to, so concurrent CREATE DATABASE
	// statements never find their template busy.
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()+" TEMPLATE template0"); err != nil {
		return "", fmt.Errorf("pgtest: creating database %s: %w", name, err)
	}
	return withDatabase(c.adminURL, name)
}

func (c *Cluster) dropDatabase(connString string) error {
	cfg, err := pgx.ParseConfig(connString)
	if err != nil {
		return err
	}
	admin, err := c.adminPool()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{cfg.Database}.Sanitize()+" WITH (FORCE)"); err != nil {
		return fmt.Errorf("dropping database %s: %w", cfg.Database, err)
	}
	return nil
}

// NewPool creates a fresh database (see NewDatabase) and returns a pool
// connected to it, closed when t ends.
func (c *Cluster) NewPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	return OpenPool(t, c.NewDatabase(t))
}

// Stop shuts the server down (pg_ctl stop -m fast): open connections are
// terminated with SQLSTATE 57P01 and new ones are refused until Start. Only a
// private cluster (NewCluster) can be stopped.
func (c *Cluster) Stop(t testing.TB) {
	t.Helper()
	if err := c.canRestart(); err != nil {
		t.Fatal(err)
	}
	if err := c.local.stop("fast"); err != nil {
		t.Fatal(err)
	}
}

// StopImmediate shuts the server down as a crash would (pg_ctl stop -m
// immediate): every server process quits at once, without a checkpoint, and
// open connections end with SQLSTATE 57P01 or a closed socket. The next
// Start runs crash recovery, which replays the WAL written before the stop:
// a commit made with synchronous_commit off whose WAL was still in the
// server's buffers (up to three times wal_writer_delay, 200 ms by default)
// is lost, as in a real crash. Only a private cluster (NewCluster) can be
// stopped.
func (c *Cluster) StopImmediate(t testing.TB) {
	t.Helper()
	if err := c.canRestart(); err != nil {
		t.Fatal(err)
	}
	if err := c.local.stop("immediate"); err != nil {
		t.Fatal(err)
	}
}

// Kill kills the postmaster with SIGKILL, as the kernel's out-of-memory
// killer would, and returns once every process of the cluster's data
// directory has exited: the backends notice the postmaster's death and
// quit on their own, and until they have, the old shared memory block is
// still in use and Start would fail. As with StopImmediate, the next Start
// runs crash recovery and commits not yet written from the WAL buffers are
// lost. Only a private cluster (NewCluster) can be killed, and only on a
// system with /proc (Linux), where Kill finds the server's processes by
// their working directory.
func (c *Cluster) Kill(t testing.TB) {
	t.Helper()
	if err := c.canRestart(); err != nil {
		t.Fatal(err)
	}
	if err := c.local.kill(); err != nil {
		t.Fatal(err)
	}
}

// Start starts a stopped (or killed) server again on the same port and
// data, and waits until it accepts connections, after crash recovery if it
// was not stopped cleanly. Only a private cluster (NewCluster) can be
// started.
func (c *Cluster) Start(t testing.TB) {
	t.Helper()
	if err := c.canRestart(); err != nil {
		t.Fatal(err)
	}
	if err := c.local.start(); err != nil {
		t.Fatal(err)
	}
	c.mu.Lock()
	if c.admin != nil {
		c.admin.Reset() // its connections died with the old server
	}
	c.mu.Unlock()
}

func (c *Cluster) canRestart() error {
	switch {
	case c.local == nil:
		return errors.New("pgtest: an external server cannot be stopped or started; use NewCluster")
	case c.shared:
		return errors.New("pgtest: the shared cluster cannot be stopped or started; use NewCluster")
	}
	return nil
}

func (c *Cluster) close() error {
	var err error
	c.mu.Lock()
	drop := c.dropAtClose
	c.dropAtClose = nil
	c.mu.Unlock()
	for _, connString := range drop {
		err = errors.Join(err, c.dropDatabase(connString))
	}
	c.mu.Lock()
	if c.admin != nil {
		c.admin.Close()
		c.admin = nil
	}
	c.mu.Unlock()
	if c.local != nil {
		err = errors.Join(err, c.local.close())
	}
	return err
}

// databaseName makes a unique, valid database name from a test name.
func databaseName(testName string) string {
	var b strings.Builder
	b.WriteString("t_")
	for _, r := range strings.ToLower(testName) {
		if b.Len() >= 40 {
			break
		}
		if (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9') {
			b.WriteRune(r)
		} else {
			b.WriteByte('_')
		}
	}
	var suffix [5]byte
	_, _ = rand.Read(suffix[:])
	return b.String() + "_" + hex.EncodeToString(suffix[:])
}

// withDatabase returns connString with its database replaced by name.
func withDatabase(connString, name string) (string, error) {
	if strings.HasPrefix(connString, "postgres://") || strings.HasPrefix(connString, "postgresql://") {
		u, err := url.Parse(connString)
		if err != nil {
			return "", fmt.Errorf("pgtest: parsing connection URL: %w", err)
		}
		u.Path = "/" + name
		u.RawPath = ""
		return u.String(), nil
	}
	// Keyword/value form: a later keyword overrides an earlier one.
	return connString + " dbname=" + name, nil
}
