package faults_test

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/fenced"
	"github.com/leaderelect/leader/internal/history"
	"github.com/leaderelect/leader/internal/monotime"
	"github.com/leaderelect/leader/postgres"
)

// In the process faults and the promotion fault, the leaders' work also
// writes to a table of the test's own in the election's database, in
// transactions that call postgres.Fence with the election name and the term
// the work was granted before they commit: the fenced writes that issue 17
// gives the library, besides the suite's own register (internal/fenced).

// Settings of the fenced transactions.
const (
	// workTable is the table the fenced transactions insert into, in the
	// election's database.
	workTable = "fenced_work"
	// statusView is the stores' status view under the default Options
	// (see postgres.Migrate): the term of each name's last grant, read in
	// the fenced transaction after Fence has locked the lease row, so that
	// it is the term that holds the lease when the transaction commits.
	statusView = "leader_leases_status"
	// txTimeout bounds a fenced transaction of the leader work: generous,
	// so that only a server that does not answer (a vanished primary)
	// makes one fail.
	txTimeout = 2 * ttl
	// txIdleTimeout is the idle_in_transaction_session_timeout of the
	// fenced transactions' sessions. A process paused inside a fenced
	// transaction holds the lease row's lock, which every grant waits for:
	// the server ends its session, as a deployment's should, so that a
	// successor can be granted. Generous for a transaction that runs.
	txIdleTimeout = ttl
)

// A fenced transaction is recorded as a fenced.Op of Kind fenced.Write on
// the resource workTable, with a Value unique among a scenario's
// transactions: Accepted if it committed (committed), not if Fence refused
// its term (refused: leader.ErrLeaseLost, the server aborted it), and
// Unknown, with Err, if it failed otherwise (a server that cannot be
// reached, a timeout: if the commit was sent, the outcome is unknown).
// Invoke is a CLOCK_MONOTONIC reading, the clock of the histories, taken
// before BEGIN; Return one taken once it ended.

// committed reports whether the fenced transaction op committed.
func committed(op fenced.Op) bool { return op.Accepted && !op.Unknown }

// refused reports whether Fence refused the fenced transaction op.
func refused(op fenced.Op) bool { return !op.Accepted && !op.Unknown }

// txFileSuffix ends the name of every file of fenced transactions;
// loadTxOps reads only those.
const txFileSuffix = ".fencedtx.jsonl"

// fencedWork makes the fenced transactions of the leaders of one process
// and appends each, once it has ended, to a file of its own, as a line
// written with O_APPEND in one write(2) (so that a process killed with
// SIGKILL leaves only complete lines), for loadTxOps. Its methods are safe
// for concurrent use.
type fencedWork struct {
	strategy string
	// primary is the pool of the server the transactions go to: the
	// election's database on the primary of the moment.
	primary atomic.Pointer[pgxpool.Pool]
	file    *os.File
}

// newFencedWork returns a fencedWork for an election on strategy whose
// transactions go to pool, and are recorded in a new file named for
// instance in dir. Close it.
func newFencedWork(strategy string, pool *pgxpool.Pool, dir, instance string) (*fencedWork, error) {
	f, err := os.OpenFile(filepath.Join(dir, instance+txFileSuffix), os.O_WRONLY|os.O_CREATE|os.O_EXCL|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	w := &fencedWork{strategy: strategy, file: f}
	w.use(pool)
	return w, nil
}

// use sends the transactions that start from now on to pool, as a client
// whose connection string names the primary of the moment does after a
// failover.
func (w *fencedWork) use(pool *pgxpool.Pool) { w.primary.Store(pool) }

// close closes w's file.
func (w *fencedWork) close() error { return w.file.Close() }

// write makes a fenced transaction on behalf of client, which the election
// granted term: it calls postgres.Fence with the election name and term,
// then inserts (client, term, value) into workTable, with the term that the
// status view shows for the election, and commits. It records the
// transaction and returns it; the error is only that of the recording.
func (w *fencedWork) write(ctx context.Context, client string, term uint64, value string) (fenced.Op, error) {
	op := fenced.Op{Kind: fenced.Write, Resource: workTable, Client: client, Term: term, Value: value}
	var err error
	if op.Invoke, err = monotime.Now(); err != nil {
		return op, err
	}
	pool := w.primary.Load() // the primary of the moment, after Invoke
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := postgres.Fence(ctx, tx, postgres.Options{}, election, term); err != nil {
			return err // BeginFunc rolls back
		}
		tag, err := tx.Exec(ctx, `INSERT INTO `+pgx.Identifier{workTable}.Sanitize()+` (writer, term, value, lease_term)
			SELECT $1, $2, $3, s.term FROM `+pgx.Identifier{statusView}.Sanitize()+` AS s WHERE s.name = $4 AND s.strategy = $5`,
			client, int64(term), value, election, w.strategy)
		if err == nil && tag.RowsAffected() != 1 {
			err = fmt.Errorf("%d rows inserted, want 1: the status view shows no %s lease of %q", tag.RowsAffected(), w.strategy, election)
		}
		return err
	})
	op.Accepted = err == nil
	if err != nil && !errors.Is(err, leader.ErrLeaseLost) {
		op.Unknown, op.Err = true, err.Error()
	}
	if op.Return, err = monotime.Now(); err != nil {
		return op, err
	}
	return op, w.record(op)
}

// record appends op to w's file.
func (w *fencedWork) record(op fenced.Op) error {
	line, err := json.Marshal(op)
	if err != nil {
		return err
	}
	_, err = w.file.Write(append(line, '\n')) // *os.File serializes writes
	return err
}

// loadTxOps reads the transactions recorded in every file of fencedWork in
// dir, by invocation time. A last line without its newline is ignored.
func loadTxOps(dir string) ([]fenced.Op, error) {
	paths, err := filepath.Glob(filepath.Join(dir, "*"+txFileSuffix))
	if err != nil {
		return nil, err
	}
	var ops []fenced.Op
	for _, path := range paths {
		b, err := os.ReadFile(path)
		if err != nil {
			return nil, err
		}
		dec := json.NewDecoder(bytes.NewReader(b[:bytes.LastIndexByte(b, '\n')+1]))
		for dec.More() {
			var op fenced.Op
			if err := dec.Decode(&op); err != nil {
				return nil, fmt.Errorf("%s: %w", path, err)
			}
			ops = append(ops, op)
		}
	}
	slices.SortStableFunc(ops, func(a, b fenced.Op) int { return cmp.Compare(a.Invoke, b.Invoke) })
	return ops, nil
}

// setupWorkTable creates workTable in pool's database.
func setupWorkTable(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	_, err := pool.Exec(callCtx(t), `CREATE TABLE `+pgx.Identifier{workTable}.Sanitize()+` (
		id bigserial PRIMARY KEY,
		writer text NOT NULL,
		term bigint NOT NULL,
		value text NOT NULL,
		lease_term bigint NOT NULL
	)`)
	if err != nil {
		t.Fatalf("creating %s: %v", workTable, err)
	}
}

// txPoolConfig returns the configuration of a pool for fenced transactions
// on connString: its sessions end when idle in a transaction for
// txIdleTimeout.
func txPoolConfig(connString string) (*pgxpool.Config, error) {
	cfg, err := pgxpool.ParseConfig(connString)
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.RuntimeParams["idle_in_transaction_session_timeout"] = fmt.Sprint(txIdleTimeout.Milliseconds())
	return cfg, nil
}

// openTxPool opens a pool for fenced transactions on connString, closed
// when t ends.
func openTxPool(t *testing.T, connString string) *pgxpool.Pool {
	t.Helper()
	cfg, err := txPoolConfig(connString)
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// staleTx counts fenced transactions made with a term after its lease was
// lost, by outcome: attempted is the sum of the other three (countTx
// counts any transactions so).
type staleTx struct{ attempted, refused, accepted, failed int }

// countTx counts ops by outcome.
func countTx(ops []fenced.Op) staleTx {
	var c staleTx
	for _, op := range ops {
		c.attempted++
		switch {
		case committed(op):
			c.accepted++
		case refused(op):
			c.refused++
		default:
			c.failed++
		}
	}
	return c
}

// add adds o's counts to c's.
func (c *staleTx) add(o staleTx) {
	c.attempted += o.attempted
	c.refused += o.refused
	c.accepted += o.accepted
	c.failed += o.failed
}

// tenure is one term of one instance.
type tenure struct {
	instance string
	term     uint64
}

// txTrial is what a trial of a fault did to a leader's fenced
// transactions: deposed lost its lease at the CLOCK_MONOTONIC reading
// lostAt (or before), and successor was elected with a greater term.
type txTrial struct {
	fault, strategy    string
	trial              int
	deposed, successor tenure
	lostAt             int64
	wantValue          string // the value of a stale transaction the trial must have made
}

// checkStaleTx checks the fenced transactions that the trial's deposed
// leader made with its term after it lost its lease: at least one
// attempted, with tr.wantValue, at least one refused (so that the check
// cannot pass vacuously), none committed; and that the successor committed
// at least one (so that the fence does not just refuse everything). It
// logs the counts in a fixed format and returns the stale transactions.
func checkStaleTx(t *testing.T, ops []fenced.Op, tr txTrial) []fenced.Op {
	t.Helper()
	var stale []fenced.Op
	successorCommitted := 0
	for _, op := range ops {
		switch {
		case op.Client == tr.deposed.instance && op.Term == tr.deposed.term && op.Invoke > tr.lostAt:
			stale = append(stale, op)
		case op.Client == tr.successor.instance && op.Term == tr.successor.term && committed(op):
			successorCommitted++
		}
	}
	c := countTx(stale)
	t.Logf("fence-stale fault=%q strategy=%s trial=%d writer=%s term=%d attempted=%d refused=%d accepted=%d failed=%d",
		tr.fault, tr.strategy, tr.trial, tr.deposed.instance, tr.deposed.term, c.attempted, c.refused, c.accepted, c.failed)
	if !slices.ContainsFunc(stale, func(op fenced.Op) bool { return op.Value == tr.wantValue }) {
		t.Errorf("trial %d: no fenced transaction %q by %s with term %d after it lost its lease: %v", tr.trial, tr.wantValue, tr.deposed.instance, tr.deposed.term, stale)
	}
	if c.refused == 0 {
		t.Errorf("trial %d: Fence refused none of the %d transactions %s made with term %d after it lost its lease: %v", tr.trial, c.attempted, tr.deposed.instance, tr.deposed.term, stale)
	}
	for _, op := range stale {
		if committed(op) {
			t.Errorf("trial %d: a stale fenced transaction committed, after %s lost term %d to %s with term %d: %v", tr.trial, tr.deposed.instance, tr.deposed.term, tr.successor.instance, tr.successor.term, op)
		}
	}
	if successorCommitted == 0 {
		t.Errorf("trial %d: the successor %s committed no fenced transaction with term %d", tr.trial, tr.successor.instance, tr.successor.term)
	}
	return stale
}

// workRow is a row of workTable.
type workRow struct {
	id              int64
	writer, value   string
	term, leaseTerm uint64
}

// staleAfterElection returns the fenced transactions in ops that began
// after a leader with a greater term than theirs had been elected, as the
// history of beliefs, intervals, shows (OnElected was called after the
// grant committed): the fence must have refused every one.
func staleAfterElection(ops []fenced.Op, intervals []history.Interval) []fenced.Op {
	var stale []fenced.Op
	for _, op := range ops {
		if slices.ContainsFunc(intervals, func(iv history.Interval) bool {
			return iv.Elected && iv.Term > op.Term && iv.ElectedAt < op.Invoke
		}) {
			stale = append(stale, op)
		}
	}
	return stale
}

// checkWorkTable reads workTable through pool and fails the test unless
// every row carries the term that held the lease when it committed (the
// lease term read in its transaction), a term that the history of beliefs,
// intervals, shows its writer was granted, and a term no smaller than that
// of any row inserted before it; and unless no row is that of a
// transaction in ops that Fence refused. It returns the number of rows.
func checkWorkTable(t *testing.T, pool *pgxpool.Pool, ops []fenced.Op, intervals []history.Interval) int {
	t.Helper()
	refusedValues := make(map[string]bool)
	for _, op := range ops {
		if refused(op) {
			refusedValues[op.Value] = true
		}
	}
	rows := readWorkTable(t, pool)
	var last workRow
	for _, row := range rows {
		switch {
		case row.term != row.leaseTerm:
			t.Errorf("%s: committed with term %d while term %d held the lease: %+v", workTable, row.term, row.leaseTerm, row)
		case !slices.ContainsFunc(intervals, func(iv history.Interval) bool { return iv.Instance == row.writer && iv.Term == row.term }):
			t.Errorf("%s: a row with term %d, which %s was never granted: %+v", workTable, row.term, row.writer, row)
		case row.term < last.term:
			t.Errorf("%s: a row with term %d after one with term %d: %+v after %+v", workTable, row.term, last.term, row, last)
		case refusedValues[row.value]:
			t.Errorf("%s: the row of a refused transaction: %+v", workTable, row)
		}
		last = row
	}
	return len(rows)
}

// readWorkTable returns the rows of workTable in the order they were
// inserted.
func readWorkTable(t *testing.T, pool *pgxpool.Pool) []workRow {
	t.Helper()
	var (
		rows []workRow
		row  workRow
	)
	rs, err := pool.Query(callCtx(t), `SELECT id, writer, term, lease_term, value FROM `+pgx.Identifier{workTable}.Sanitize()+` ORDER BY id`)
	if err == nil {
		_, err = pgx.ForEachRow(rs, []any{&row.id, &row.writer, &row.term, &row.leaseTerm, &row.value}, func() error {
			rows = append(rows, row)
			return nil
		})
	}
	if err != nil {
		t.Fatalf("reading %s: %v", workTable, err)
	}
	return rows
}

// staleTxCells returns the table cells of c: a dash for each when the
// scenario made no stale fenced transaction.
func staleTxCells(c staleTx) string {
	if c.attempted == 0 {
		return "– | – | – | –"
	}
	return strings.Join([]string{fmt.Sprint(c.attempted), fmt.Sprint(c.refused), fmt.Sprint(c.accepted), fmt.Sprint(c.failed)}, " | ")
}

// lateTxValue is the value of the fenced transaction a test makes on behalf
// of a deposed leader.
func lateTxValue(instance string, term uint64) string {
	return fmt.Sprintf("%s/%d/late", instance, term)
}

// fenceTx makes a fenced transaction of the leader work through w, bounded
// by txTimeout whether or not ctx, the leader context, ends meanwhile (a
// transaction already begun is let finish), and fails the test only if it
// could not be recorded: refusals and failures are the test's to count.
func fenceTx(t *testing.T, ctx context.Context, w *fencedWork, client string, term uint64, value string) {
	tctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), txTimeout)
	defer cancel()
	if _, err := w.write(tctx, client, term, value); err != nil {
		t.Errorf("%s: recording a fenced transaction: %v", client, err)
	}
}

// checkFencedWork checks a scenario's fenced transactions, ops: each
// trial's stale ones (checkStaleTx); every one that began after a greater
// term's leader was elected must not have committed (staleAfterElection);
// and the table, read through pool, must hold only rows of the terms that
// held the lease (checkWorkTable). It logs the counts and returns the count
// of stale transactions, those of the trials and those after an election,
// each once.
func checkFencedWork(t *testing.T, pool *pgxpool.Pool, ops []fenced.Op, intervals []history.Interval, trials []txTrial) staleTx {
	t.Helper()
	stale := make(map[string]fenced.Op) // by value
	for _, tr := range trials {
		for _, op := range checkStaleTx(t, ops, tr) {
			stale[op.Value] = op
		}
	}
	for _, op := range staleAfterElection(ops, intervals) {
		stale[op.Value] = op
		if committed(op) {
			t.Errorf("a fenced transaction committed after a leader with a greater term was elected: %v", op)
		}
	}
	rows := checkWorkTable(t, pool, ops, intervals)
	total, c := countTx(ops), countTx(slices.Collect(maps.Values(stale)))
	t.Logf("fenced transactions: %d, %d committed; %d rows in %s; stale: %d attempted, %d refused, %d accepted, %d failed",
		total.attempted, total.accepted, rows, workTable, c.attempted, c.refused, c.accepted, c.failed)
	return c
}
