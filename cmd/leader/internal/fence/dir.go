//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package fence

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
)

// StoreDir returns the directory that holds the fences of the embedded
// store in storeDir: its subdirectory "fences". Next to the store, the fence
// is shared by every process that shares the store, whatever their
// environment (XDG_RUNTIME_DIR, TMPDIR, a private /tmp) and whichever path
// (through symlinks) they name it by; storeDir should have its symlinks
// resolved, as it names the election's fence uniquely. The embedded store
// names its own files "<encoded name>.<suffix>", never a directory, so the
// subdirectory takes nothing from it.
func StoreDir(storeDir string) string {
	return filepath.Join(storeDir, "fences")
}

// HostDir returns the per-user directory of the host that holds the fences
// of stores not on this host (PostgreSQL): /tmp/leader-fence-<uid>. It is a
// fixed path, not one from TMPDIR or XDG_RUNTIME_DIR, so that instances
// started from a login shell, from cron or from a service manager agree on
// it. (A service with a private /tmp, such as systemd's PrivateTmp, does
// not share it: on those stores the lease's TTL already orders the
// commands, and the fence matters only for several instances on one host.) Acquire creates it with
// mode 0700 and refuses it if it is not a directory owned by this user and
// closed to others.
func HostDir() string {
	return filepath.Join("/tmp", "leader-fence-"+strconv.Itoa(os.Getuid()))
}

// checkPrivate makes sure dir exists, is a directory (not a symlink) owned
// by this user, with no access for others, creating it if needed: in a
// directory every user can write to, another user could have made it first.
func checkPrivate(dir string) error {
	if err := os.Mkdir(dir, 0o700); err != nil && !os.IsExist(err) {
		return err
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	switch {
	case !fi.IsDir():
		return fmt.Errorf("%s is not a directory", dir)
	case ok && int(st.Uid) != os.Getuid():
		return fmt.Errorf("%s is owned by uid %d, not by this user (%d)", dir, st.Uid, os.Getuid())
	case fi.Mode().Perm()&0o077 != 0:
		return fmt.Errorf("%s is open to other users (mode %v); want 0700", dir, fi.Mode().Perm())
	}
	return nil
}
