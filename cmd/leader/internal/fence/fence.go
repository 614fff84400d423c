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
// is closed.
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
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("fence: %w", err)
	}
	wait := time.Millisecond
	for first := true; ; first = false {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return f, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) && !errors.Is(err, syscall.EINTR) {
			f.Close()
			return nil, fmt.Errorf("fence: locking %s: %w", path, err)
		}
		if first && onWait != nil {
			onWait()
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			f.Close()
			return nil, fmt.Errorf("fence: %w", ctx.Err())
		case <-t.C:
		}
		wait = min(2*wait, 20*time.Millisecond)
	}
}
