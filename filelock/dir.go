package filelock

import (
	"errors"
	"os"
	"path/filepath"
	"runtime"
)

// DefaultDir returns the per-user directory that the leader command
// suggests for the embedded store (it uses none unless named, as
// file:///dir): $XDG_STATE_HOME/leader, or
// ~/.local/state/leader when XDG_STATE_HOME is unset or not absolute, on
// Linux and the BSDs; the user's configuration directory plus "leader"
// elsewhere (~/Library/Application Support/leader on macOS). It is a state
// directory, not a cache or a runtime directory, because the terms kept there
// must survive reboots and cache cleaning. DefaultDir does not create it;
// Open does.
func DefaultDir() (string, error) {
	switch runtime.GOOS {
	case "darwin", "ios", "windows", "plan9":
		dir, err := os.UserConfigDir()
		if err != nil {
			return "", err
		}
		return filepath.Join(dir, "leader"), nil
	}
	if dir := os.Getenv("XDG_STATE_HOME"); filepath.IsAbs(dir) {
		return filepath.Join(dir, "leader"), nil
	}
	home, err := os.UserHomeDir()
	if err != nil {
		return "", err
	}
	if home == "" {
		return "", errors.New("filelock: no home directory for the default store")
	}
	return filepath.Join(home, ".local", "state", "leader"), nil
}
