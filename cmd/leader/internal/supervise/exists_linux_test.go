package supervise

import (
	"fmt"
	"os"
	"strings"
	"syscall"
)

// exists reports whether process pid runs: it exists and is not a zombie.
func exists(pid int) bool {
	err := syscall.Kill(pid, 0)
	if err != nil {
		return false
	}
	// A zombie exists until reaped but runs nothing; a process shown dead
	// (X) is being reaped.
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	fields := strings.Fields(string(b))
	return len(fields) < 3 || (fields[2] != "Z" && fields[2] != "X")
}
