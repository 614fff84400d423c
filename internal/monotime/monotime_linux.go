package monotime

import (
	"os"
	"syscall"
	"unsafe"
)

// clockMonotonic is CLOCK_MONOTONIC from <time.h>.
const clockMonotonic = 1

// Now reads CLOCK_MONOTONIC in nanoseconds. On Linux it is also the clock
// the Go runtime's monotonic readings and timers use, and it stops while the
// host is suspended.
func Now() (int64, error) {
	var ts syscall.Timespec
	_, _, errno := syscall.RawSyscall(syscall.SYS_CLOCK_GETTIME, clockMonotonic, uintptr(unsafe.Pointer(&ts)), 0)
	if errno != 0 {
		return 0, os.NewSyscallError("clock_gettime", errno)
	}
	return ts.Nano(), nil
}
