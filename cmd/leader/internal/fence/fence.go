//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

// Package fence keeps two commands of one election from running at once on
// one host, even for the few milliseconds in which a dead leader's command is
// being killed while the lease is already free.
//
// On the embedded file-lock store the kernel frees the lease the instant a
// leader process dies, and the next leader is elected within milliseconds,
// while the dead leader's supervisor is still killing its command's process
// group. So before starting its command, a new leader takes the election's
// fence: a file in a per-user directory, locked with flock. The supervisor of
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
	"strconv"
	"syscall"
	"time"
)

// Dir returns the directory that holds fences: $XDG_RUNTIME_DIR/leader/fences
// when XDG_RUNTIME_DIR is set, else <temp dir>/leader-<uid>/fences. Fences
// must be shared by every leader process of the host that might run the same
// election, so the directory is per user, not per store.
func Dir() string {
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" {
		return filepath.Join(d, "leader", "fences")
	}
	return filepath.Join(os.TempDir(), "leader-"+strconv.Itoa(os.Getuid()), "fences")
}

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
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
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
