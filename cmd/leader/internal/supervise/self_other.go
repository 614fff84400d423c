//go:build darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package supervise

import "os"

// SelfExecutable returns the path that re-executes the running binary:
// os.Executable. Unlike /proc/self/exe on Linux, this is a path name: if the
// file was replaced since the leader process started (a deploy), the
// supervisor runs the new binary.
func SelfExecutable() (string, error) {
	return os.Executable()
}
