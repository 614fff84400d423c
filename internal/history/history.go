// Package history records who believed it led an election, and when, and
// checks the record for the failures DESIGN.md's invariants rule out: two
// believed leaderships of one name that overlap (invariant 1), a term that is
// not above the previous holder's (invariant 2), and a takeover slower than a
// bound (invariant 4).
//
// # Recording
//
// Every participant (an Elector under test, in this process or another one on
// the same host) writes events through a Recorder, which appends one line per
// event to a file of its own with a single write(2) on a file opened with
// O_APPEND: a participant killed with SIGKILL leaves only complete lines.
// Load reads the files of every participant from one directory. Timestamps
// are CLOCK_MONOTONIC readings (package monotime), the one clock all
// processes on a host share; they are never compared across hosts.
//
// A participant records through two things, both from its Recorder:
//
//   - a RecordingStore, wrapping the leader.Store its Elector uses, records
//     each granted Acquire (when it was sent and when it was answered), each
//     successful Renew, and each Release;
//   - the hooks from Hooks, set as the Elector's OnElected and OnDemoted,
//     record when OnElected is called, when the leader context is seen
//     cancelled, and when OnDemoted is called.
//
// # Conservative intervals
//
// What is checked is not the true interval in which an Elector believed it
// led (IsLeader true) but an interval recorded around it, [Start, End], with
// Start no later than the true start and End no earlier than the true end.
// If these intervals do not overlap, the true ones do not either; the checker
// can report an overlap that did not happen (when the bounds are loose) but
// never misses one that did.
//
//   - Start: the Elector starts believing only after the granting Acquire
//     call has returned to it, so the moment the RecordingStore saw that call
//     return is a lower bound of the start, and so is the moment it sent the
//     call (Bounds.StartAtSend: a wider interval, which also covers the
//     instant the store made the grant). The time OnElected is called is not
//     a lower bound: the Elector turns IsLeader true first. Without a
//     RecordingStore only that time is known; such an interval is marked
//     (Interval.Granted false) and its start is not conservative.
//   - End: the Elector stops believing (IsLeader false) and then cancels the
//     leader context, before OnDemoted and before it releases the lease. So
//     the time an AfterFunc on the leader context runs, the time OnDemoted is
//     called and the time the Release is sent are each an upper bound of the
//     end; the checker takes the earliest one recorded.
//
// # Crashes
//
// A participant killed with SIGKILL leaves an open interval: a start and no
// end. Its true end is not in the record, so the caller supplies one through
// Bounds.OpenEnd: the time the test killed the process (EndOpenAt), or the
// latest moment the Elector's own deadline allows (EndOpenAtDeadline, valid
// only for a process whose timers kept running, which a paused process's do
// not). An open interval given no end is treated as never ending, and
// reported (Report.Unended), so an unexplained open interval fails the check.
package history

import (
	"fmt"
	"time"
)

// Kind says what an Event records.
type Kind string

// The kinds of events. At is the CLOCK_MONOTONIC reading, in nanoseconds,
// at the moment described.
const (
	// Granted: an Acquire call granted the lease; Sent is when the call was
	// sent, At when it returned.
	Granted Kind = "granted"
	// Renewed: a Renew call succeeded; Sent is when it was sent, At when it
	// returned.
	Renewed Kind = "renewed"
	// Released: a Release call was about to be sent.
	Released Kind = "released"
	// Elected: OnElected was called.
	Elected Kind = "elected"
	// Ended: the leader context given to OnElected was seen cancelled.
	Ended Kind = "ended"
	// Demoted: OnDemoted was called.
	Demoted Kind = "demoted"
)

func (k Kind) valid() bool {
	switch k {
	case Granted, Renewed, Released, Elected, Ended, Demoted:
		return true
	}
	return false
}

// Event is one line of a participant's history.
type Event struct {
	// At is the CLOCK_MONOTONIC reading, in nanoseconds, when it happened.
	At int64 `json:"at"`
	// Sent is, for Granted and Renewed, when the call was sent; else 0.
	Sent int64 `json:"sent,omitempty"`
	// Kind is what happened.
	Kind Kind `json:"kind"`
	// Name is the election name.
	Name string `json:"name"`
	// Instance names the participant: one Elector.
	Instance string `json:"instance"`
	// Term is the fencing term of the leadership the event belongs to.
	Term uint64 `json:"term"`
}

func (e Event) String() string {
	s := fmt.Sprintf("%d %s %s/%s term %d", e.At, e.Kind, e.Name, e.Instance, e.Term)
	if e.Sent != 0 {
		s += fmt.Sprintf(" (sent %d)", e.Sent)
	}
	return s
}

// ns formats a difference of CLOCK_MONOTONIC readings.
func ns(d int64) time.Duration { return time.Duration(d) }
