//go:build darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package supervise

import (
	"os/exec"
	"strconv"
	"strings"
	"syscall"
)

// exists reports whether process pid runs: it exists and is not a zombie.
// Without /proc, ps tells zombies apart (state Z); if ps fails, the process
// counts as running as long as kill(pid, 0) still finds it.
func exists(pid int) bool {
	if err := syscall.Kill(pid, 0); err != nil {
		return false
	}
	out, err := exec.Command("ps", "-o", "stat=", "-p", strconv.Itoa(pid)).Output()
	if err != nil {
		// ps exits 1 when no such process: it was reaped meanwhile.
		return syscall.Kill(pid, 0) == nil
	}
	return !strings.HasPrefix(strings.TrimSpace(string(out)), "Z")
}
