//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package supervise

import (
	"fmt"
	"time"

	"github.com/leaderelect/leader/internal/monotime"
)

// Deadline is a moment on the host's CLOCK_MONOTONIC, in nanoseconds: an
// absolute time that every process on the host reads alike (Go's own
// monotonic readings are relative to each process's start, so they cannot
// cross a process boundary). The supervisor stops the command when its
// deadline passes; see Options.Deadline and Child.Extend.
//
// Being absolute, a deadline computed by a leader process that is then
// frozen (SIGSTOP, a cgroup freezer, a debugger) and sent late extends
// nothing: by the time it arrives it has passed.
type Deadline int64

// DeadlineAt converts t, a time read in this process with its monotonic
// reading (for example time.Now().Add(d)), to a Deadline. The clock is read
// before time.Until, so that a pause between the two makes the deadline
// earlier, never later.
func DeadlineAt(t time.Time) (Deadline, error) {
	now, err := monotime.Now()
	if err != nil {
		return 0, fmt.Errorf("supervise: reading the monotonic clock: %w", err)
	}
	return Deadline(now + int64(time.Until(t))), nil
}

// until returns how long is left before d, on the host's monotonic clock.
func (d Deadline) until() (time.Duration, error) {
	now, err := monotime.Now()
	if err != nil {
		return 0, err
	}
	return time.Duration(int64(d) - now), nil
}
