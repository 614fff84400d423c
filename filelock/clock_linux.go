package filelock

import (
	"os"
	"strings"

	"github.com/leaderelect/leader/internal/monotime"
)

// clockName says in the state file which clock the *_clock_ns fields use.
const clockName = "CLOCK_MONOTONIC"

// clockResetsAtBoot: CLOCK_MONOTONIC starts again near zero at every boot.
const clockResetsAtBoot = true

// monotonicNow reads CLOCK_MONOTONIC: the same for every process on the
// host, never set and never stepped (only slewed) by NTP, and stopped while
// the host is suspended. It is the clock the Elector's own deadlines run on,
// so the store and its leaders agree on how long a lease has left even
// across a wall-clock jump or a suspend.
func monotonicNow() (int64, error) { return monotime.Now() }

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
