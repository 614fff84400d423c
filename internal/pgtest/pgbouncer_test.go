package pgtest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// connect opens one connection to connString, closed when t ends.
func connect(t *testing.T, connString string) *pgx.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, connString)
	if err != nil {
		t.Fatalf("connecting to %s: %v", connString, err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

// backendPID runs SELECT pg_backend_pid() on conn in a transaction of its
// own and returns the process that ran it.
func backendPID(t *testing.T, conn *pgx.Conn) uint32 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var pid uint32
	err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		return tx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid)
	})
	if err != nil {
		t.Fatalf("SELECT pg_backend_pid(): %v", err)
	}
	return pid
}

func TestPgBouncerInTransactionModeHidesTheBackendFromStartUp(t *testing.T) {
	t.Parallel()
	connString := PgBouncer(t, NewDatabase(t), "transaction")
	first, second := connect(t, connString), connect(t, connString)
	if mode := first.Config().DefaultQueryExecMode; mode != pgx.QueryExecModeExec {
		t.Errorf("the connection string %s gives query exec mode %v, want exec", connString, mode)
	}

	firstBackend := backendPID(t, first)
	// first is idle now, so its server connection may serve second.
	secondBackend := backendPID(t, second)

	for _, c := range []struct {
		name    string
		conn    *pgx.Conn
		backend uint32
	}{{"first", first, firstBackend}, {"second", second, secondBackend}} {
		if startup := c.conn.PgConn().PID(); startup == c.backend {
			t.Errorf("%s connection: the start-up process ID %d is the backend's; PgBouncer should have sent its own", c.name, startup)
		}
	}
	if firstBackend == secondBackend {
		t.Logf("both connections were served by backend %d", firstBackend)
	} else {
		t.Logf("the connections were served by backends %d and %d", firstBackend, secondBackend)
	}
}

func TestDirectConnectionShowsItsBackendAtStartUp(t *testing.T) {
	t.Parallel()
	conn := connect(t, NewDatabase(t))
	if startup, backend := conn.PgConn().PID(), backendPID(t, conn); startup != backend {
		t.Fatalf("start-up process ID %d, but pg_backend_pid() is %d", startup, backend)
	}
}

func TestPgBouncerServesQueriesInEveryPoolMode(t *testing.T) {
	t.Parallel()
	connString := NewDatabase(t)
	for _, mode := range pgBouncerPoolModes {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			pool := OpenPool(t, PgBouncer(t, connString, mode))
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			var database string
			if err := pool.QueryRow(ctx, "SELECT current_database()").Scan(&database); err != nil {
				t.Fatal(err)
			}
			if want := pool.Config().ConnConfig.Database; database != want {
				t.Fatalf("current_database() = %q through PgBouncer, want %q", database, want)
			}
		})
	}
}

func TestPgBouncerRefusesAnUnknownPoolMode(t *testing.T) {
	t.Parallel()
	_, err := startPgBouncer("postgres://postgres@127.0.0.1:1/db", "connection")
	if err == nil || !strings.Contains(err.Error(), "transaction") {
		t.Fatalf("startPgBouncer with pool mode %q: error %v, want one that lists the modes", "connection", err)
	}
}

func TestPgBouncerStopLeavesNoProcessOrFiles(t *testing.T) {
	t.Parallel()
	b, err := startPgBouncer(NewDatabase(t), "transaction")
	if err != nil {
		t.Fatal(err)
	}
	pid, addr := b.cmd.Process.Pid, pgBouncerAddr(t, b.connString)
	if err := b.stop(); err != nil {
		t.Fatal(err)
	}
	// stop waited for the process, so its ID is free at once.
	if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
		t.Errorf("after stop, signalling PgBouncer's process %d gives %v, want ESRCH", pid, err)
	}
	if conn, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		conn.Close()
		t.Errorf("after stop, %s still accepts connections", addr)
	}
	if _, err := os.Stat(b.dir); !os.IsNotExist(err) {
		t.Errorf("after stop, PgBouncer's directory %s: %v, want it removed", b.dir, err)
	}
	if err := b.stop(); err != nil {
		t.Errorf("second stop: %v", err)
	}
}

func TestPgBouncerIsStoppedWhenTheTestEnds(t *testing.T) {
	t.Parallel()
	connString := NewDatabase(t)
	var addr string
	t.Run("inner", func(t *testing.T) {
		addr = pgBouncerAddr(t, PgBouncer(t, connString, "session"))
	})
	if conn, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		conn.Close()
		t.Fatalf("PgBouncer at %s still accepts connections after its test ended", addr)
	}
}

// TestPgBouncerIsStoppedWhenTheBinaryCrashes runs this test binary again as
// a child that starts PgBouncer and panics, and checks that the watchdog
// stops PgBouncer and removes its files.
func TestPgBouncerIsStoppedWhenTheBinaryCrashes(t *testing.T) {
	if os.Getenv("PGTEST_PGBOUNCER_CRASH_CHILD") == "1" {
		b, err := startPgBouncer(NewDatabase(t), "transaction")
		if err != nil {
			t.Fatal(err)
		}
		fmt.Printf("pgbouncer addr=%s dir=%s\n", pgBouncerAddr(t, b.connString), b.dir)
		panic("deliberate crash with PgBouncer running")
	}
	t.Parallel()
	cmd := exec.Command(os.Args[0], "-test.run=^TestPgBouncerIsStoppedWhenTheBinaryCrashes$", "-test.count=1")
	cmd.Env = append(os.Environ(), "PGTEST_PGBOUNCER_CRASH_CHILD=1")
	out, err := cmd.CombinedOutput()
	if err == nil {
		t.Fatalf("child did not crash:\n%s", out)
	}
	m := regexp.MustCompile(`pgbouncer addr=(\S+) dir=(\S+)`).FindSubmatch(out)
	if m == nil {
		t.Fatalf("child printed no PgBouncer:\n%s", out)
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
			t.Fatalf("30s after the crash: PgBouncer at %s dial error %v, directory %s stat error %v", addr, dialErr, dir, statErr)
		}
		time.Sleep(20 * time.Millisecond) // poll interval
	}
}

func TestPgBouncerDatabaseLineQuotesValues(t *testing.T) {
	t.Parallel()
	cfg, err := pgconn.ParseConfig("host=db.example port=6543 sslmode=disable")
	if err != nil {
		t.Fatal(err)
	}
	cfg.User, cfg.Password, cfg.Database = "o'brien", "p w'd;#", "my-db"
	got, err := pgBouncerDatabase(cfg)
	want := `"my-db" = host='db.example' port='6543' user='o''brien' password='p w''d;#' dbname='my-db'`
	if err != nil || got != want {
		t.Fatalf("pgBouncerDatabase = %q, %v; want %q", got, err, want)
	}
	if got := pgBouncerServerTLS(cfg); got != "disable" {
		t.Errorf("server TLS mode for sslmode=disable: %q, want disable", got)
	}

	cfg.Password = "line\nbreak"
	if _, err := pgBouncerDatabase(cfg); err == nil {
		t.Error("a password with a line break was accepted")
	}
}

func TestFindPgBouncer(t *testing.T) {
	// Not parallel: it changes PATH.
	t.Setenv("PATH", t.TempDir()) // no pgbouncer
	fallback := filepath.Join(t.TempDir(), "pgbouncer")

	_, err := findPgBouncerIn(fallback)
	if err == nil {
		t.Fatal("found pgbouncer where there is none")
	}
	for _, want := range []string{"PATH", fallback, "apt-get install pgbouncer"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}

	if err := os.WriteFile(fallback, nil, 0o755); err != nil {
		t.Fatal(err)
	}
	if got, err := findPgBouncerIn(fallback); err != nil || got != fallback {
		t.Fatalf("findPgBouncerIn = %q, %v; want %q", got, err, fallback)
	}
}

// pgBouncerAddr returns the host:port that a connection string from
// PgBouncer points at.
func pgBouncerAddr(t testing.TB, connString string) string {
	t.Helper()
	u, err := url.Parse(connString)
	if err != nil {
		t.Fatal(err)
	}
	return u.Host
}
