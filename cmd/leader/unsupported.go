//go:build !(linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd)

package main

import (
	"fmt"
	"os"
	"runtime"
)

// The leader command supervises its command through Unix process groups and
// signals, and its embedded store and fences need flock(2): on other systems
// (Windows, Solaris, AIX, ...) it only says so and exits 1. The library
// packages build there all the same.
func main() {
	fmt.Fprintf(os.Stderr, "leader: the leader command is not supported on %s: it needs Unix process groups, signals and flock(2) (Linux, macOS, the BSDs, illumos)\n", runtime.GOOS)
	os.Exit(1)
}
