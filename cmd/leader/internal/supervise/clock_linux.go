package supervise

import (
	"os"
	"syscall"
	"unsafe"
)

// clockMonotonic is CLOCK_MONOTONIC from <time.h>.
const clockMonotonic = 1

// monotonicNow reads CLOCK_MONOTONIC: nanoseconds since a point shortly
// before boot, the same for every process on the host, never set or stepped,
// stopped while the host is suspended. It is also the clock the Go runtime's
// monotonic readings and timers use on Linux.
func monotonicNow() (int64, error) {
	var ts syscall.Timespec
	_, _, errno := syscall.RawSyscall(syscall.SYS_CLOCK_GETTIME, clockMonotonic, uintptr(unsafe.Pointer(&ts)), 0)
	if errno != 0 {
		return 0, os.NewSyscallError("clock_gettime", errno)
	}
	return ts.Nano(), nil
}
