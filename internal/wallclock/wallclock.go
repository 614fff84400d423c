// Package wallclock is where the library reads the wall clock: for what it
// shows (times in Status and Lease, logs, status output), never for what it
// decides. Deadlines, expiries and timers run on monotonic clocks (Go's
// monotonic reading, CLOCK_MONOTONIC, or the store's clock), which a step of
// the wall clock does not move.
//
// Tests step this clock (Step) to check that a wall-clock jump, such as an
// NTP step or an operator setting the date, changes no decision: times from
// Now carry no monotonic reading, so anything compared or subtracted with
// them follows the steps.
package wallclock

import (
	"sync/atomic"
	"time"
)

// offset is the sum of the steps, in nanoseconds.
var offset atomic.Int64

// Now returns the wall-clock time, moved by the steps made so far, without a
// monotonic reading.
func Now() time.Time { return time.Now().Round(0).Add(time.Duration(offset.Load())) }

// Step moves the clock by d (forward when d is positive) for every reader in
// this process. It is for tests.
func Step(d time.Duration) { offset.Add(int64(d)) }

// Offset returns the sum of the steps made so far.
func Offset() time.Duration { return time.Duration(offset.Load()) }
