package supervise

import "os"

// SelfExecutable returns the path that re-executes the running binary:
// /proc/self/exe, so that the supervisor is the very same binary as the
// leader process even if the file was replaced (a deploy) or removed since it
// started; os.Executable if /proc is not mounted.
func SelfExecutable() (string, error) {
	const self = "/proc/self/exe"
	if _, err := os.Stat(self); err == nil {
		return self, nil
	}
	return os.Executable()
}
