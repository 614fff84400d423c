package filelock

import (
	"os"
	"strings"
	"syscall"
	"unsafe"
)

// clockName says in the state file which clock the *_clock_ns fields use.
const clockName = "CLOCK_MONOTONIC"

// clockResetsAtBoot: CLOCK_MONOTONIC starts again near zero at every boot.
const clockResetsAtBoot = true

// clockMonotonic is CLOCK_MONOTONIC from <time.h>, the clock Go's runtime
// reads for monotonic time on Linux.
const clockMonotonic = 1

// monotonicNow reads CLOCK_MONOTONIC: nanoseconds since an arbitrary point
// shortly before boot, the same for every process on the host, never set
// and never stepped (only slewed) by NTP, and stopped while the host is
// suspended. It is the clock the Elector's own deadlines run on, so the store
// and its leaders agree on how long a lease has left even across a wall-clock
// jump or a suspend.
func monotonicNow() (int64, error) {
	var ts syscall.Timespec
	_, _, errno := syscall.RawSyscall(syscall.SYS_CLOCK_GETTIME, clockMonotonic, uintptr(unsafe.Pointer(&ts)), 0)
	if errno != 0 {
		return 0, os.NewSyscallError("clock_gettime", errno)
	}
	return ts.Nano(), nil
}

// bootID returns the kernel's random ID of the current boot, or "" if it
// cannot be read (no /proc). Monotonic readings from another boot mean
// nothing now; a state whose boot ID differs was written before a reboot,
// when every holder of the time died.
func bootID() string {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}
