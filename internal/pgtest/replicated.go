package pgtest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// ReplicationOptions configure a cluster started by NewReplicatedCluster.
type ReplicationOptions struct {
	// Synchronous makes the standby synchronous: the primary's
	// synchronous_standby_names names it, so a commit on the primary
	// returns only once the standby has flushed its WAL, and blocks while
	// replication is cut or black-holed. False (the default) makes it
	// asynchronous: a commit returns once the primary has flushed it.
	Synchronous bool
}

// ReplicatedCluster is a private primary with one hot standby that streams
// its WAL, for tests of what clients see when the primary fails over. The
// standby reaches the primary through a proxy that the test can cut or
// black-hole (CutReplication, BlackHoleReplication), and clients can reach
// the primary through another (PrimaryProxied), which VanishPrimary
// black-holes. Both servers are superuser-only throwaway clusters, like
// NewCluster's, each on its own port and temporary directory, with its own
// watchdog. Its methods are safe for concurrent use.
type ReplicatedCluster struct {
	primary, standby *localServer
	replication      *proxy // the standby's connection to the primary
	clients          *proxy // PrimaryProxied's connections to the primary
	database         string // on the primary, made before the base backup
}

// standbyName is the standby's application_name, which
// synchronous_standby_names and pg_stat_replication know it by, and the
// name of its replication slot on the primary.
const standbyName = "standby"

// primarySettings go into the primary's postgresql.conf, after
// serverSettings. synchronous_commit is on, so that a commit that returned
// is in the WAL that WaitReplayed waits for, and WAL is flushed (fsync
// stays off) before it is sent. WAL the standby has not received is kept
// for it by its replication slot, however long replication is cut.
const primarySettings = `
wal_level = replica
max_wal_senders = 10
max_replication_slots = 10
synchronous_commit = on
`

// standbySettings go into the standby's postgresql.conf, after the
// primary's, which pg_basebackup copied. After a failed connection to the
// primary, the standby tries again after wal_retrieve_retry_interval (5 s
// by default): short, so that HealReplication takes effect at once.
const standbySettings = `
unix_socket_directories = '%s'
hot_standby = on
wal_retrieve_retry_interval = '100ms'
`

// replicationHBA lets the superuser open replication connections from
// 127.0.0.1, which initdb's pg_hba.conf does too; it is written out so as
// not to depend on initdb's sample.
const replicationHBA = "\nhost replication postgres 127.0.0.1/32 trust\n"

// NewReplicatedCluster starts a private primary and a streaming standby of
// it for t, both stopped and removed, and the proxies closed, when t ends.
// It returns once the standby streams (and, when synchronous, is the
// primary's synchronous standby). Like NewCluster, it always starts them
// from the installed binaries, which must include pg_basebackup, even when
// LEADER_TEST_DATABASE_URL is set, and fails t if it cannot.
//
// A fresh database is created on the primary before the base backup, so
// the standby has it from the start: Primary, PrimaryProxied and Standby
// name it. Databases and roles created later on the primary replicate too.
func NewReplicatedCluster(t testing.TB, opts ReplicationOptions) *ReplicatedCluster {
	t.Helper()
	c, err := startReplicated(t.Name(), opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.close(); err != nil {
			t.Errorf("pgtest: stopping replicated cluster: %v", err)
		}
	})
	return c
}

func startReplicated(hint string, opts ReplicationOptions) (c *ReplicatedCluster, err error) {
	c = &ReplicatedCluster{database: databaseName(hint)}
	defer func() {
		if err != nil {
			err = errors.Join(err, c.close())
			c = nil
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	if c.primary, err = newLocalServer(); err != nil {
		return c, err
	}
	if err := hasBinary(c.primary.binDir, "pg_basebackup"); err != nil {
		return c, err
	}
	if err := c.primary.initdb(); err != nil {
		return c, err
	}
	if err := errors.Join(
		c.primary.appendToFile("postgresql.conf", primarySettings),
		c.primary.appendToFile("pg_hba.conf", replicationHBA),
	); err != nil {
		return c, err
	}
	if err := c.primary.start(); err != nil {
		return c, err
	}
	if err := execSQL(ctx, c.primary.connString("postgres"), "CREATE DATABASE "+pgx.Identifier{c.database}.Sanitize()); err != nil {
		return c, fmt.Errorf("pgtest: creating database %s on the primary: %w", c.database, err)
	}

	if c.replication, err = startProxy(c.primary.addr()); err != nil {
		return c, err
	}
	if c.clients, err = startProxy(c.primary.addr()); err != nil {
		return c, err
	}

	if c.standby, err = newLocalServer(); err != nil {
		return c, err
	}
	if err := c.standby.baseBackup(c.replication.addr()); err != nil {
		return c, err
	}
	if err := c.standby.appendToFile("postgresql.conf", fmt.Sprintf(standbySettings, c.standby.rootDir)); err != nil {
		return c, err
	}
	if err := c.standby.start(); err != nil {
		return c, err
	}
	if err := c.waitStreaming(ctx, "async"); err != nil {
		return c, err
	}
	if opts.Synchronous {
		// Only now: a synchronous standby named before it streams would
		// block every commit, pg_basebackup's own included; and set with
		// ALTER SYSTEM, in the primary's postgresql.auto.conf, which the
		// base backup has already copied without it, so that the standby,
		// once promoted, does not wait for a standby of its own.
		err := execSQL(ctx, c.primary.connString("postgres"),
			"ALTER SYSTEM SET synchronous_standby_names = '"+standbyName+"'",
			"SELECT pg_reload_conf()")
		if err != nil {
			return c, fmt.Errorf("pgtest: making the standby synchronous: %w", err)
		}
		if err := c.waitStreaming(ctx, "sync"); err != nil {
			return c, err
		}
	}
	return c, nil
}

// baseBackup makes the server's data directory a standby of the server at
// addr: pg_basebackup copies it, streaming the WAL written meanwhile, and
// creates a physical replication slot for it; -R writes standby.signal,
// and primary_conninfo (to addr) and primary_slot_name to
// postgresql.auto.conf.
func (s *localServer) baseBackup(addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("pgtest: base backup from %q: %w", addr, err)
	}
	conninfo := fmt.Sprintf("host=%s port=%s user=postgres application_name=%s", host, port, standbyName)
	out, err := s.run(2*time.Minute, "pg_basebackup", "-D", s.dataDir, "-d", conninfo,
		"-R", "-X", "stream", "-c", "fast", "-C", "-S", standbyName, "--no-sync")
	if err != nil {
		return fmt.Errorf("pgtest: pg_basebackup from %s: %w\n%s", addr, err, out)
	}
	return nil
}

// waitStreaming waits until the primary's pg_stat_replication shows the
// standby streaming with the sync_state given ("async" or "sync").
func (c *ReplicatedCluster) waitStreaming(ctx context.Context, syncState string) error {
	conn, err := pgx.Connect(ctx, c.primary.connString("postgres"))
	if err != nil {
		return fmt.Errorf("pgtest: connecting to the primary: %w", err)
	}
	defer conn.Close(context.Background())
	for {
		var state string
		err := conn.QueryRow(ctx, "SELECT sync_state FROM pg_stat_replication WHERE application_name = $1 AND state = 'streaming'", standbyName).Scan(&state)
		switch {
		case err == nil && state == syncState:
			return nil
		case err != nil && !errors.Is(err, pgx.ErrNoRows):
			return fmt.Errorf("pgtest: waiting for the standby to stream (sync_state %s): %w\nstandby log:\n%s", syncState, err, c.standby.logTail())
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("pgtest: the standby does not stream with sync_state %s (now %q): %w\nstandby log:\n%s", syncState, state, ctx.Err(), c.standby.logTail())
		case <-time.After(20 * time.Millisecond): // poll interval
		}
	}
}

// Primary returns a connection string for the superuser "postgres" on the
// cluster's database on the primary, straight to its port.
func (c *ReplicatedCluster) Primary() string { return c.primary.connString(c.database) }

// PrimaryProxied returns a connection string like Primary's that reaches
// the primary through a proxy, which VanishPrimary black-holes. Use it for
// the clients under test.
func (c *ReplicatedCluster) PrimaryProxied() string {
	return "postgres://postgres@" + c.clients.addr() + "/" + c.database + "?sslmode=disable"
}

// Standby returns a connection string for the superuser "postgres" on the
// cluster's database on the standby: read-only (SQLSTATE 25006 on a write)
// until Promote.
func (c *ReplicatedCluster) Standby() string { return c.standby.connString(c.database) }

// WaitReplayed waits until the standby has replayed the primary's WAL up
// to its current write position (pg_current_wal_lsn), so that whatever
// was committed on the primary before the call is visible on the standby.
// A commit made with synchronous_commit set off in its session may be
// left out: its WAL is written up to 200 ms later. It fails t after 30 s,
// as while replication is cut or black-holed, or if the primary cannot be
// reached.
func (c *ReplicatedCluster) WaitReplayed(t testing.TB) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var target string
	if err := queryRow(ctx, c.primary.connString("postgres"), "SELECT pg_current_wal_lsn()::text", nil, &target); err != nil {
		t.Fatalf("pgtest: WaitReplayed: reading the primary's WAL position: %v", err)
	}
	conn, err := pgx.Connect(ctx, c.standby.connString("postgres"))
	if err != nil {
		t.Fatalf("pgtest: WaitReplayed: connecting to the standby: %v", err)
	}
	defer conn.Close(context.Background())
	for {
		var replayed *string
		var done bool
		err := conn.QueryRow(ctx, "SELECT pg_last_wal_replay_lsn()::text, coalesce(pg_last_wal_replay_lsn() >= $1::pg_lsn, false)", target).Scan(&replayed, &done)
		if err == nil && done {
			return
		}
		if err != nil && ctx.Err() == nil {
			t.Fatalf("pgtest: WaitReplayed: reading the standby's replay position: %v", err)
		}
		select {
		case <-ctx.Done():
			at := "nothing"
			if replayed != nil {
				at = *replayed
			}
			t.Fatalf("pgtest: WaitReplayed: after 30s the standby has replayed up to %s, not the primary's %s (is replication cut or black-holed?)\nstandby log:\n%s", at, target, c.standby.logTail())
		case <-time.After(10 * time.Millisecond): // poll interval
		}
	}
}

// CutReplication resets the standby's connection to the primary, and every
// new one it makes, until HealReplication: the standby's WAL receiver and
// the primary's WAL sender both see a reset connection. The primary keeps
// the WAL the standby misses (its replication slot).
func (c *ReplicatedCluster) CutReplication() { c.replication.cut() }

// BlackHoleReplication makes the standby's connection to the primary go
// silent, both ways, until HealReplication: nothing passes, neither bytes
// nor FIN nor RST, and a new connection is accepted and held likewise. The
// WAL sender and receiver notice only by their own timeouts
// (wal_sender_timeout, wal_receiver_timeout: 60 s).
func (c *ReplicatedCluster) BlackHoleReplication() { c.replication.blackHole() }

// HealReplication ends CutReplication or BlackHoleReplication: what a
// black hole held is delivered, and the standby, which after a cut tries to
// reconnect every 100 ms, streams again.
func (c *ReplicatedCluster) HealReplication() { c.replication.heal() }

// Promote promotes the standby (pg_promote) and returns once it accepts
// writes (pg_is_in_recovery() is false). Its timeline is the primary's
// plus one. The primary runs on, unaware, as after a failover that did not
// fence it; the standby no longer follows it.
func (c *ReplicatedCluster) Promote(t testing.TB) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	var promoted bool
	if err := queryRow(ctx, c.standby.connString("postgres"), "SELECT pg_promote(wait => true, wait_seconds => 60)", nil, &promoted); err != nil {
		t.Fatalf("pgtest: promoting the standby: %v", err)
	}
	if !promoted {
		t.Fatalf("pgtest: the standby was not promoted within 60s\nstandby log:\n%s", c.standby.logTail())
	}
	var inRecovery bool
	if err := queryRow(ctx, c.standby.connString("postgres"), "SELECT pg_is_in_recovery()", nil, &inRecovery); err != nil {
		t.Fatalf("pgtest: after promoting the standby: %v", err)
	}
	if inRecovery {
		t.Fatal("pgtest: pg_promote returned true, yet the standby is still in recovery")
	}
}

// VanishPrimary makes the primary's host vanish: the connections through
// PrimaryProxied and the standby's replication connection go silent (as
// BlackHoleReplication: no FIN, no RST; new connections are held), then
// the primary server stops at once (pg_ctl stop -m immediate), which its
// clients through the proxies never hear of. A query on such a connection
// hangs until its context ends. Primary's connections, straight to the
// server, are closed, and new ones refused. The standby can then be
// promoted.
func (c *ReplicatedCluster) VanishPrimary(t testing.TB) {
	t.Helper()
	c.clients.blackHole()
	c.replication.blackHole()
	if err := c.primary.stop("immediate"); err != nil {
		t.Fatal(err)
	}
}

// close stops both servers at once, removes their files and closes the
// proxies, resetting whatever connections they still hold. It copes with
// a cluster that was only partly started.
func (c *ReplicatedCluster) close() error {
	var err error
	for _, s := range []*localServer{c.standby, c.primary} {
		if s != nil {
			err = errors.Join(err, s.close())
		}
	}
	for _, p := range []*proxy{c.replication, c.clients} {
		if p != nil {
			p.close()
		}
	}
	return err
}

// Timeline returns the timeline ID of the primary server connString names:
// 1 for a new cluster, one more at each promotion. It reads it from the
// name of the current WAL file, whose first 8 hex digits are the timeline,
// with
//
//	SELECT substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8)
//
// which any role may run, and which gives the new timeline as soon as a
// promoted standby accepts writes. (pg_control_checkpoint()'s timeline_id
// gives it only after the checkpoint that follows the promotion, which the
// server makes in the background.) pg_walfile_name refuses to run during
// recovery: Timeline fails t on a standby.
func Timeline(t testing.TB, connString string) uint32 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, connString)
	if err != nil {
		t.Fatalf("pgtest: Timeline: %v", err)
	}
	defer conn.Close(context.Background())
	var inRecovery bool
	if err := conn.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&inRecovery); err != nil {
		t.Fatalf("pgtest: Timeline: %v", err)
	}
	if inRecovery {
		t.Fatal("pgtest: Timeline: the server is in recovery (a standby); pg_walfile_name works only on a primary")
	}
	var hex string
	if err := conn.QueryRow(ctx, "SELECT substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8)").Scan(&hex); err != nil {
		t.Fatalf("pgtest: Timeline: %v", err)
	}
	tli, err := strconv.ParseUint(hex, 16, 32)
	if err != nil {
		t.Fatalf("pgtest: Timeline: the WAL file name starts with %q, not a timeline ID", hex)
	}
	return uint32(tli)
}

// execSQL runs each statement on a connection of its own to connString.
func execSQL(ctx context.Context, connString string, statements ...string) error {
	conn, err := pgx.Connect(ctx, connString)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	for _, sql := range statements {
		if _, err := conn.Exec(ctx, sql); err != nil {
			return fmt.Errorf("%s: %w", sql, err)
		}
	}
	return nil
}

// queryRow runs sql with args on a connection of its own to connString and
// scans its one row into dest.
func queryRow(ctx context.Context, connString, sql string, args []any, dest ...any) error {
	conn, err := pgx.Connect(ctx, connString)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	return conn.QueryRow(ctx, sql, args...).Scan(dest...)
}

// hasBinary reports, as an error, whether binDir lacks the program name.
func hasBinary(binDir, name string) error {
	fi, err := os.Stat(filepath.Join(binDir, name))
	if err != nil || fi.IsDir() || fi.Mode()&0o111 == 0 {
		return fmt.Errorf("pgtest: no %s beside the server binaries in %s; a replicated cluster needs it (Debian: apt-get install postgresql-client)", name, binDir)
	}
	return nil
}
