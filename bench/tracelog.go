package main

import (
	"fmt"
	"os"
	"strings"
	"sync"

	"github.com/jackc/pgx/v5"

	"github.com/leaderelect/leader/internal/monotime"
)

// envTrace, when set in the bench's environment (the children inherit
// it), has each candidate child write a line to its standard error (the
// -child-log file) for every statement it starts and ends through pgx, and
// when it stops, calls Acquire, Release or ReleaseTo (or prepares a
// handover) and is elected, each stamped
// with CLOCK_MONOTONIC and the process ID:
//
//	TRACE <ns> <pid> start be=<backend pid> <the statement's first 70 characters>
//	TRACE <ns> <pid> end be=<backend pid> err=<error>
//	TRACE <ns> <pid> stopping|stopped|elected|demoted <candidate ID>
//	TRACE <ns> <pid> acquire start
//	TRACE <ns> <pid> acquire end ok=<granted> err=<error>
//	TRACE <ns> <pid> prepare <successor ID> start
//	TRACE <ns> <pid> prepare end err=<error>
//	TRACE <ns> <pid> release start|end err=<error>
//	TRACE <ns> <pid> release-to <successor ID> start
//	TRACE <ns> <pid> release-to end err=<error>
//
// Sorted by time, the lines of all children tell where a handover's time
// went. Statements of a pgconn pipeline (an advisory release, a prepared
// handover's commit) and of the stores' own pools are not traced. It costs time in every statement: measure without it.
const envTrace = "LEADERBENCH_TRACE"

var (
	traceOn = os.Getenv(envTrace) != ""
	traceMu sync.Mutex
)

// tracef writes a trace line, if tracing is on.
func tracef(format string, args ...any) {
	if !traceOn {
		return
	}
	t, err := monotime.Now()
	if err != nil {
		return
	}
	msg := fmt.Sprintf(format, args...)
	traceMu.Lock()
	defer traceMu.Unlock()
	fmt.Fprintf(os.Stderr, "TRACE %d %d %s\n", t, os.Getpid(), msg)
}

// traceStatement traces a statement's start (sql) or end (err).
func traceStatement(conn *pgx.Conn, start bool, sql string, err error) {
	if !traceOn {
		return
	}
	if start {
		sql = strings.Join(strings.Fields(sql), " ")
		if len(sql) > 70 {
			sql = sql[:70]
		}
		tracef("start be=%d %s", conn.PgConn().PID(), sql)
		return
	}
	tracef("end be=%d err=%v", conn.PgConn().PID(), err)
}
