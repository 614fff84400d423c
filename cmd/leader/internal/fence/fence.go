//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

// Package fence keeps two commands of one election from running at once on
// one host, even for the few milliseconds in which a dead leader's command is
// being killed while the lease is already free.
//
// On the embedded file-lock store the kernel frees the lease the instant a
// leader process dies, and the next leader is elected within milliseconds,
// while the dead leader's supervisor is still killing its command's process
// group. So before starting its command, a new leader takes the election's
// fence: a file locked with flock, in the store's directory (StoreDir) for
// the embedded store, and in a fixed per-user directory (HostDir) for the
// others. The supervisor of
// the running command holds that lock until its command's whole process group
// is gone (see package supervise), so the new command starts only after the
// old one has ended. Across hosts (PostgreSQL) the lease's TTL already orders
// them; the fence costs nothing there.
//
// The fence file is removed when its hold ends (see Release), so the fence
// directory holds one file per fence in use, not one per election ever run.
package fence

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"time"
)

// Path returns the fence file in dir for election name on the store
// identified by storeID (a string that names the store without secrets).
func Path(dir, storeID, name string) string {
	sum := sha256.Sum256([]byte(storeID + "\x00" + name))
	return filepath.Join(dir, hex.EncodeToString(sum[:12])+".fence")
}

// Acquire locks the fence file at path, waiting until no one else holds it
// or ctx ends. onWait, if not nil, is called once if the fence is not free
// at the first try. The lock is held until the returned file, and every
// descriptor duplicated from it (for example one passed to a child process),
// is closed; the last holder ends the hold with Release, which removes the
// file.
//
// The lock belongs to the file, not to the path: a process that opened the
// file before its holder removed it would lock a file nobody else can open
// any more. So once locked, Acquire checks that path still names the file it
// locked, and starts again with the file path names now if not. Removal is
// safe because only a holder removes the file, and only while it still holds
// the lock (see Release): while a holder's lock is held, path names its file.
func Acquire(ctx context.Context, path string, onWait func()) (*os.File, error) {
	dir := filepath.Dir(path)
	if dir == HostDir() {
		// In the shared /tmp: it must be this user's alone.
		if err := checkPrivate(dir); err != nil {
			return nil, fmt.Errorf("fence: %w", err)
		}
	} else if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("fence: %w", err)
	}
	for {
		f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
		if err != nil {
			return nil, fmt.Errorf("fence: %w", err)
		}
		if err := lock(ctx, f, onWait); err != nil {
			f.Close()
			return nil, err
		}
		onWait = nil
		same, err := names(path, f)
		if err != nil {
			f.Close()
			return nil, fmt.Errorf("fence: %w", err)
		}
		if same {
			return f, nil
		}
		// Removed (and perhaps created again) by the holder this one
		// waited for.
		f.Close()
	}
}

// lock takes the flock of f, waiting (polling, so that ctx can end the
// wait) until it is free. onWait, if not nil, is called if it is not free at
// the first try.
func lock(ctx context.Context, f *os.File, onWait func()) error {
	wait := time.Millisecond
	for first := true; ; first = false {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) && !errors.Is(err, syscall.EINTR) {
			return fmt.Errorf("fence: locking %s: %w", f.Name(), err)
		}
		if first && onWait != nil {
			onWait()
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("fence: %w", ctx.Err())
		case <-t.C:
		}
		wait = min(2*wait, 20*time.Millisecond)
	}
}

// names reports whether path names the file f has open.
func names(path string, f *os.File) (bool, error) {
	held, err := f.Stat()
	if err != nil {
		return false, err
	}
	named, err := os.Lstat(path)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return os.SameFile(held, named), nil
}

// Release ends the hold of a fence that Acquire returned: it removes the
// fence file, if its path (f.Name()) still names it, then closes f, which
// frees the lock. So the fence directory holds files only for the fences
// held now (and for any whose last holder was killed before it could
// release them; the next hold of that fence removes it).
//
// Call it instead of Close only where the hold ends: f must be the last
// descriptor of the lock that anyone relies on. While a process (such as a
// supervisor) holds a duplicate for a command that still runs, close f
// instead, and let that process call Release. A waiter that opened the file
// before it was removed finds that out once it gets the lock, and opens the
// new one (see Acquire).
func Release(f *os.File) error {
	defer f.Close()
	same, err := names(f.Name(), f)
	if err != nil || !same {
		return err
	}
	// Nobody else can remove or replace the file between the check and the
	// removal: only the holder of its lock removes it, and a new file is
	// created only where none is.
	if err := os.Remove(f.Name()); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("fence: %w", err)
	}
	return nil
}
