package pgtest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// execOn runs sql on a connection of its own to connString and fails t if
// it fails.
func execOn(t *testing.T, connString, sql string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := execSQL(ctx, connString, sql); err != nil {
		t.Fatalf("on %s: %v", connString, err)
	}
}

// rows returns the values of column x of table kept, in order.
func rows(t *testing.T, connString string) []int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn := connect(t, connString)
	rs, _ := conn.Query(ctx, "SELECT x FROM kept ORDER BY x")
	xs, err := pgx.CollectRows(rs, pgx.RowTo[int])
	if err != nil {
		t.Fatalf("reading kept on %s: %v", connString, err)
	}
	return xs
}

func checkRows(t *testing.T, where, connString string, want ...int) {
	t.Helper()
	if got := rows(t, connString); !equalInts(got, want) {
		t.Fatalf("the %s has rows %v, want %v", where, got, want)
	}
}

func equalInts(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// asUser returns connString with its user replaced.
func asUser(t *testing.T, connString, user string) string {
	t.Helper()
	u, err := url.Parse(connString)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(user)
	return u.String()
}

func TestStandbyReplaysWhatThePrimaryCommits(t *testing.T) {
	t.Parallel()
	c := NewReplicatedCluster(t, ReplicationOptions{})
	execOn(t, c.Primary(), "CREATE TABLE kept (x int); INSERT INTO kept VALUES (1)")
	c.WaitReplayed(t)
	checkRows(t, "standby", c.Standby(), 1)
	checkRows(t, "primary through its proxy", c.PrimaryProxied(), 1)

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := connect(t, c.Standby()).Exec(ctx, "INSERT INTO kept VALUES (2)")
	if pgErr := (*pgconn.PgError)(nil); !errors.As(err, &pgErr) || pgErr.Code != "25006" {
		t.Fatalf("a write on the standby returned %v, want SQLSTATE 25006 (read-only transaction)", err)
	}
}

func TestPromotingACutOffStandbyLosesTheCommitsItMissed(t *testing.T) {
	t.Parallel()
	c := NewReplicatedCluster(t, ReplicationOptions{})
	execOn(t, c.Primary(), "CREATE TABLE kept (x int); INSERT INTO kept VALUES (1)")
	c.WaitReplayed(t)

	c.CutReplication()
	execOn(t, c.Primary(), "INSERT INTO kept VALUES (2)") // committed, on the primary only
	c.Promote(t)

	checkRows(t, "promoted standby", c.Standby(), 1)
	checkRows(t, "old primary", c.Primary(), 1, 2)
	execOn(t, c.Standby(), "INSERT INTO kept VALUES (3)")
	checkRows(t, "promoted standby", c.Standby(), 1, 3)
}

func TestSynchronousCommitWaitsForTheStandby(t *testing.T) {
	t.Parallel()
	c := NewReplicatedCluster(t, ReplicationOptions{Synchronous: true})
	execOn(t, c.Primary(), "CREATE TABLE kept (x int)")

	// insert commits x on the primary, giving up the wait for the standby
	// after timeout, and returns how long it took and whether it gave up.
	insert := func(t *testing.T, x int, timeout time.Duration) (time.Duration, bool) {
		t.Helper()
		cfg, err := pgx.ParseConfig(c.Primary())
		if err != nil {
			t.Fatal(err)
		}
		var mu sync.Mutex
		var gaveUp bool
		cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
			if strings.Contains(n.Message, "canceling wait for synchronous replication") {
				mu.Lock()
				gaveUp = true
				mu.Unlock()
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		conn, err := pgx.ConnectConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(context.Background())
		// A cancel request ends the wait, not the commit, which is
		// already local: the statement returns with a warning.
		// (statement_timeout cannot: the server disarms it before it
		// commits.)
		cancelWait := time.AfterFunc(timeout, func() { _ = conn.PgConn().CancelRequest(ctx) })
		defer cancelWait.Stop()
		start := time.Now()
		if _, err := conn.Exec(ctx, "INSERT INTO kept VALUES ($1)", x); err != nil {
			t.Fatalf("INSERT %d: %v", x, err)
		}
		mu.Lock()
		defer mu.Unlock()
		return time.Since(start), gaveUp
	}

	if took, gaveUp := insert(t, 1, 10*time.Second); gaveUp {
		t.Fatalf("with the standby streaming, a commit gave up waiting for it after %v", took)
	}
	want := []int{1} // the rows committed so far
	for i, fault := range []struct {
		name   string
		inject func()
	}{
		{"cut", c.CutReplication},
		{"black-holed", c.BlackHoleReplication},
	} {
		t.Run("a commit blocks while replication is "+fault.name+", and replicates once healed", func(t *testing.T) {
			blocked, after := 10*(i+1), 10*(i+1)+1
			fault.inject()
			const timeout = time.Second
			took, gaveUp := insert(t, blocked, timeout)
			if !gaveUp || took < timeout {
				t.Errorf("with replication %s, a commit returned after %v (gave up waiting for the standby: %v), want a wait of %v cut short", fault.name, took, gaveUp, timeout)
			}
			want = append(want, blocked)
			c.HealReplication()
			c.WaitReplayed(t)
			checkRows(t, "standby", c.Standby(), want...)
			if took, gaveUp := insert(t, after, 10*time.Second); gaveUp {
				t.Fatalf("once healed, a commit gave up waiting for the standby after %v", took)
			}
			want = append(want, after)
		})
	}
}

func TestPromotedStandbyIsOnTheNextTimeline(t *testing.T) {
	t.Parallel()
	c := NewReplicatedCluster(t, ReplicationOptions{})
	// A role without any privilege, to show that Timeline's query needs
	// none; created on the primary, it replicates.
	execOn(t, c.Primary(), "CREATE ROLE plain LOGIN")
	c.WaitReplayed(t)
	primary := Timeline(t, asUser(t, c.Primary(), "plain"))
	if primary != 1 {
		t.Errorf("a new cluster's primary is on timeline %d, want 1", primary)
	}

	c.Promote(t)
	standby := asUser(t, c.Standby(), "plain")
	if got := Timeline(t, standby); got != primary+1 {
		t.Fatalf("the promoted standby is on timeline %d, want the primary's %d + 1", got, primary)
	}
	if got := Timeline(t, asUser(t, c.Primary(), "plain")); got != primary {
		t.Errorf("the old primary moved to timeline %d, want it on %d", got, primary)
	}
	// pg_control_checkpoint() reports the timeline of the last
	// checkpoint, which follows the promotion in the background.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var checkpointTimeline uint32
	if err := connect(t, standby).QueryRow(ctx, "SELECT timeline_id FROM pg_control_checkpoint()").Scan(&checkpointTimeline); err != nil {
		t.Logf("pg_control_checkpoint() as an unprivileged role: %v", err)
	} else {
		t.Logf("just after the promotion, pg_control_checkpoint() says timeline %d", checkpointTimeline)
	}
}

func TestVanishedPrimaryLeavesItsClientsHanging(t *testing.T) {
	t.Parallel()
	c := NewReplicatedCluster(t, ReplicationOptions{})
	client := connect(t, c.PrimaryProxied())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := client.Ping(ctx); err != nil {
		t.Fatal(err)
	}

	c.VanishPrimary(t)
	const wait = 1500 * time.Millisecond
	start := time.Now() // before the deadline is set, so that took >= wait
	qctx, qcancel := context.WithTimeout(context.Background(), wait)
	defer qcancel()
	var one int
	err := client.QueryRow(qctx, "SELECT 1").Scan(&one)
	took := time.Since(start)
	if !errors.Is(err, context.DeadlineExceeded) || took < wait {
		t.Errorf("a query to the vanished primary returned after %v with %v, want the context's deadline after %v", took, err, wait)
	}
	if conn, err := net.DialTimeout("tcp", c.primary.addr(), 5*time.Second); err == nil {
		conn.Close()
		t.Error("the vanished primary's server still accepts connections")
	}

	// The failover the harness is for.
	c.Promote(t)
	execOn(t, c.Standby(), "CREATE TABLE after_failover (x int)")
}

// TestReplicatedClusterIsRemovedWhenTheBinaryCrashes runs this test binary
// again as a child that starts a replicated cluster and panics, and checks
// that the watchdogs stop both servers and remove their files.
func TestReplicatedClusterIsRemovedWhenTheBinaryCrashes(t *testing.T) {
	if os.Getenv("PGTEST_CRASH_CHILD") == "replicated" {
		c := NewReplicatedCluster(t, ReplicationOptions{})
		for _, s := range []*localServer{c.primary, c.standby} {
			fmt.Printf("server addr=%s dir=%s\n", s.addr(), s.rootDir)
		}
		panic("deliberate crash with a replicated cluster running")
	}
	t.Parallel()
	cmd := exec.Command(os.Args[0], "-test.run=^TestReplicatedClusterIsRemovedWhenTheBinaryCrashes$", "-test.count=1")
	cmd.Env = append(os.Environ(), "PGTEST_CRASH_CHILD=replicated")
	out, err := cmd.CombinedOutput()
	if err == nil {
		t.Fatalf("child did not crash:\n%s", out)
	}
	servers := regexp.MustCompile(`server addr=(\S+) dir=(\S+)`).FindAllSubmatch(out, -1)
	if len(servers) != 2 {
		t.Fatalf("child printed %d servers, want 2:\n%s", len(servers), out)
	}
	deadline := time.Now().Add(30 * time.Second)
	for _, m := range servers {
		addr, dir := string(m[1]), string(m[2])
		for {
			_, statErr := os.Stat(dir)
			conn, dialErr := net.DialTimeout("tcp", addr, time.Second)
			if conn != nil {
				conn.Close()
			}
			if os.IsNotExist(statErr) && dialErr != nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("30s after the crash: server at %s dial error %v, directory %s stat error %v", addr, dialErr, dir, statErr)
			}
			time.Sleep(20 * time.Millisecond) // poll interval
		}
	}
}
