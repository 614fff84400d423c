//go:build !linux

package filelock

import "time"

// clockName says in the state file which clock the *_clock_ns fields use.
const clockName = "wall"

// clockResetsAtBoot: the wall clock goes on across reboots.
const clockResetsAtBoot = false

// monotonicNow returns the wall clock in nanoseconds. Outside Linux the
// standard library offers no system-wide monotonic clock, so expiry follows
// the wall clock there, and a wall-clock step can end or lengthen leases.
func monotonicNow() (int64, error) { return time.Now().UnixNano(), nil }

// bootID is unknown outside Linux; see the Linux version.
func bootID() string { return "" }
