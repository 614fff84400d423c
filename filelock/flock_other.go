//go:build !(linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd)

package filelock

import (
	"errors"
	"os"
	"runtime"
)

// supported reports whether this platform has flock(2).
const supported = false

var errUnsupported = errors.New("filelock: not supported on " + runtime.GOOS + " (needs flock(2))")

func tryLock(*os.File) (bool, error) { return false, errUnsupported }

func unlock(*os.File) error { return errUnsupported }

func checkLocking(string) error { return errUnsupported }

func isReadOnlyFS(error) bool { return false }

func cannotSyncDir(error) bool { return false }
