//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package filelock

import (
	"errors"
	"fmt"
	"os"
	"syscall"
)

// supported reports whether this platform has flock(2).
const supported = true

// tryLock takes an exclusive flock(2) on f without blocking. It reports
// false, with a nil error, when another open file description holds a lock
// on the file, whether in this process or another.
func tryLock(f *os.File) (bool, error) {
	return flock(f, syscall.LOCK_EX|syscall.LOCK_NB)
}

// unlock drops the flock(2) on f. Closing f would drop it too, but only once
// every descriptor sharing f's open file description is closed: a child
// forked at the wrong moment could keep it a little longer.
func unlock(f *os.File) error {
	_, err := flock(f, syscall.LOCK_UN)
	return err
}

// checkLocking fails if the file system under dir does not support
// flock(2), by taking and dropping a shared lock on the directory itself.
func checkLocking(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	ok, err := flock(d, syscall.LOCK_SH|syscall.LOCK_NB)
	if err != nil {
		return fmt.Errorf("file system does not support flock(2): %w", err)
	}
	if ok {
		_, err = flock(d, syscall.LOCK_UN)
	}
	return err
}

func flock(f *os.File, how int) (bool, error) {
	conn, err := f.SyscallConn()
	if err != nil {
		return false, err
	}
	var lockErr error
	err = conn.Control(func(fd uintptr) {
		for {
			lockErr = syscall.Flock(int(fd), how)
			if !errors.Is(lockErr, syscall.EINTR) {
				return
			}
		}
	})
	if err != nil {
		return false, err
	}
	if errors.Is(lockErr, syscall.EWOULDBLOCK) {
		return false, nil
	}
	if lockErr != nil {
		return false, &os.PathError{Op: "flock", Path: f.Name(), Err: lockErr}
	}
	return true, nil
}

// isReadOnlyFS reports whether err says the file system is mounted read-only.
func isReadOnlyFS(err error) bool { return errors.Is(err, syscall.EROFS) }

// cannotSyncDir reports whether err says the file system cannot fsync a
// directory.
func cannotSyncDir(err error) bool {
	return errors.Is(err, syscall.EINVAL) || errors.Is(err, syscall.ENOTSUP)
}
