//go:build darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package monotime

import (
	"os"

	"golang.org/x/sys/unix"
)

// Now reads CLOCK_MONOTONIC in nanoseconds. (On macOS it keeps counting
// while the host sleeps, unlike the Go runtime's own monotonic clock there.)
func Now() (int64, error) {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		return 0, os.NewSyscallError("clock_gettime", err)
	}
	return ts.Nano(), nil
}
