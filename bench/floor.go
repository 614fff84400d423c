package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// The floor: what the server and the machine take, with no elector, for
// the steps a PostgreSQL handover is made of. Each trial times one step
// from the moment the first connection sends it to the moment the second
// connection's reply is in, on loopback, in the bench process (three
// connections: one holds the lock, one waits for it, one watches pg_locks
// until it does):
//
//   - round_trip: SELECT 1, on one connection.
//   - lock_wake: a session waits in a transaction for an advisory lock
//     (shared, as a prepared handover's successor waits), then runs
//     SELECT 1 and commits; from the holder's unlock to the waiter's reply.
//   - handover: the holder updates one row and commits, then unlocks, in
//     one pipeline (as a prepared handover's commit: its release, then the
//     unlock); the waiter, woken, updates another row and commits (its
//     grant). From the holder's send to the waiter's reply.
//
// A transfer's leaderless gap (from OnDemoted's return to the successor's
// OnElected) has the handover's steps, with the stores' own statements in
// place of the one-row updates, two processes in place of one, and the
// Electors' work at both ends: the floor is the least it could take on
// this machine.
const (
	scFloor          = "floor"
	floorSetup       = "postgres-floor"
	seriesRoundTrip  = "round_trip"
	seriesLockWake   = "lock_wake"
	seriesHandover   = "handover"
	floorDatabase    = "lb_floor"
	floorWaitTimeout = 10 * time.Second
	// The advisory lock of the steps: keys (1, 1), shown in pg_locks as
	// classid 1, objid 1, objsubid 2.
	floorLock   = "SELECT pg_advisory_lock(1, 1)"
	floorUnlock = "SELECT pg_advisory_unlock(1, 1)"
)

// measureFloor times trials of each of the floor's steps, interleaved,
// a few milliseconds apart.
func (b *bench) measureFloor(ctx context.Context, trials int) Result {
	start := time.Now()
	r := Result{Scenario: scFloor, Setup: floorSetup, Kind: "postgres", Trials: trials}
	defer func() { r.WallSec = time.Since(start).Seconds() }()
	series, err := b.floorTrials(ctx, trials)
	if err != nil {
		r.Error = err.Error()
		return r
	}
	r.SeriesMs = series
	if s := series[seriesHandover]; len(s) > 0 {
		sum := summarize(s)
		r.Summary = &sum
	}
	return r
}

func (b *bench) floorTrials(ctx context.Context, trials int) (map[string][]float64, error) {
	if err := b.db.createDatabase(ctx, floorDatabase, "", nil); err != nil {
		return nil, err
	}
	defer b.db.dropDatabase(context.Background(), floorDatabase)
	var conns [3]*pgx.Conn // the holder, the waiter, and one that watches
	for i := range conns {
		c, err := pgx.Connect(ctx, b.db.connString(floorDatabase, "", ""))
		if err != nil {
			return nil, err
		}
		defer c.Close(context.Background())
		conns[i] = c
	}
	holder, waiter, watch := conns[0], conns[1], conns[2]
	if _, err := holder.Exec(ctx, `CREATE TABLE floor (id int PRIMARY KEY, v bigint NOT NULL);
		INSERT INTO floor VALUES (1, 0), (2, 0)`); err != nil {
		return nil, err
	}
	// Warm up every statement on its connection, so that no trial plans.
	for range 3 {
		if _, err := holder.Exec(ctx, "SELECT 1"); err != nil {
			return nil, err
		}
		if _, err := floorWake(ctx, holder, waiter, watch, false); err != nil {
			return nil, err
		}
		if _, err := floorWake(ctx, holder, waiter, watch, true); err != nil {
			return nil, err
		}
	}
	series := map[string][]float64{}
	for range trials {
		t0 := time.Now()
		if _, err := holder.Exec(ctx, "SELECT 1"); err != nil {
			return nil, err
		}
		series[seriesRoundTrip] = append(series[seriesRoundTrip], ms(int64(time.Since(t0))))
		for _, write := range []bool{false, true} {
			time.Sleep(time.Millisecond + rand.N(4*time.Millisecond))
			d, err := floorWake(ctx, holder, waiter, watch, write)
			if err != nil {
				return nil, err
			}
			name := seriesLockWake
			if write {
				name = seriesHandover
			}
			series[name] = append(series[name], ms(int64(d)))
		}
	}
	return series, nil
}

// floorWake times one lock_wake step, or one handover step if write: the
// holder takes the lock, the waiter's transaction waits for it (watch
// tells when it does), and then the holder lets go.
func floorWake(ctx context.Context, holder, waiter, watch *pgx.Conn, write bool) (time.Duration, error) {
	if _, err := holder.Exec(ctx, floorLock); err != nil {
		return 0, err
	}
	done := make(chan floorReply, 1)
	go func() {
		var b pgx.Batch
		b.Queue("BEGIN")
		b.Queue("SET LOCAL lock_timeout = '10s'")
		b.Queue("SELECT pg_advisory_xact_lock_shared(1, 1)")
		if write {
			// As a grant's: its commit waits for its WAL to be written
			// (durableCommit in the postgres package).
			b.Queue("SET LOCAL synchronous_commit = local")
			b.Queue("UPDATE floor SET v = v + 1 WHERE id = 2")
		} else {
			b.Queue("SELECT 1")
		}
		b.Queue("COMMIT")
		err := waiter.SendBatch(ctx, &b).Close()
		done <- floorReply{time.Now(), err}
	}()
	until := time.Now().Add(floorWaitTimeout)
	for {
		var waiting bool
		if err := watch.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_locks
			WHERE locktype = 'advisory' AND classid = 1 AND objid = 1 AND objsubid = 2 AND NOT granted)`).Scan(&waiting); err != nil {
			return 0, unlockAfter(ctx, holder, done, err)
		}
		if waiting {
			break
		}
		if time.Now().After(until) {
			return 0, unlockAfter(ctx, holder, done, fmt.Errorf("the waiter did not wait for the lock within %v", floorWaitTimeout))
		}
	}
	t0 := time.Now()
	var err error
	if write {
		pl := holder.PgConn().StartPipeline(ctx)
		pl.SendQueryParams("UPDATE floor SET v = v + 1 WHERE id = 1", nil, nil, nil, nil)
		pl.SendPipelineSync()
		pl.SendQueryParams(floorUnlock, nil, nil, nil, nil)
		pl.SendPipelineSync()
		err = pl.Flush()
		for i := 0; err == nil && i < 4; i++ {
			var res any
			res, err = pl.GetResults()
			if rr, ok := res.(*pgconn.ResultReader); ok {
				_, err = rr.Close()
			}
		}
		err = errors.Join(err, pl.Close())
	} else {
		_, err = holder.Exec(ctx, floorUnlock)
	}
	rep := <-done
	if err = errors.Join(err, rep.err); err != nil {
		return 0, err
	}
	return rep.at.Sub(t0), nil
}

// floorReply is when the waiter's reply was in, or its error.
type floorReply struct {
	at  time.Time
	err error
}

// unlockAfter lets go of the holder's lock after cause, a failure, and
// returns cause with the unlock's and the waiter's errors.
func unlockAfter(ctx context.Context, holder *pgx.Conn, done <-chan floorReply, cause error) error {
	_, err := holder.Exec(ctx, floorUnlock)
	return errors.Join(cause, err, (<-done).err)
}
