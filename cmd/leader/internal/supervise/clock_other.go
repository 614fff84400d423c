//go:build darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package supervise

import (
	"os"

	"golang.org/x/sys/unix"
)

// monotonicNow reads CLOCK_MONOTONIC with clock_gettime: a host-wide clock
// that is never set or stepped. (On macOS it keeps counting while the host
// sleeps, unlike the Go runtime's own monotonic clock there; a deadline
// given on it can then pass early after a sleep, never late.)
func monotonicNow() (int64, error) {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		return 0, os.NewSyscallError("clock_gettime", err)
	}
	return ts.Nano(), nil
}
