package filelock

import (
	"context"
	"os"
	"time"
)

// tryLockFile opens path, creating it, and locks it without blocking. It
// returns nil, with a nil error, if another open file holds the lock.
func tryLockFile(path string) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	ok, err := tryLock(f)
	if err != nil || !ok {
		f.Close()
		return nil, err
	}
	return f, nil
}

// lockFileWait opens path, creating it, and locks it, retrying with a short
// backoff while others hold it, until ctx ends. (A blocking flock(2) could
// not be abandoned when ctx ends.)
func lockFileWait(ctx context.Context, path string) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	backoff := 100 * time.Microsecond
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for {
		ok, err := tryLock(f)
		if err != nil {
			f.Close()
			return nil, err
		}
		if ok {
			return f, nil
		}
		if timer == nil {
			timer = time.NewTimer(backoff)
		} else {
			timer.Reset(backoff)
		}
		select {
		case <-timer.C:
		case <-ctx.Done():
			f.Close()
			return nil, ctx.Err()
		}
		backoff = min(2*backoff, 5*time.Millisecond)
	}
}

// unlockFile unlocks and closes a file that tryLockFile or lockFileWait
// locked.
func unlockFile(f *os.File) error {
	err := unlock(f)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}
