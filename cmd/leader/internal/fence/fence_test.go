//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package fence

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"
)

func TestAcquireWaitsForTheHolder(t *testing.T) {
	t.Parallel()
	path := Path(t.TempDir(), "file:///x", "job")
	first, err := Acquire(context.Background(), path, nil)
	if err != nil {
		t.Fatal(err)
	}
	// A descriptor duplicated from the holder keeps the lock after the
	// holder closes its own, as a supervisor's inherited copy does.
	dupped, err := syscall.Dup(int(first.Fd()))
	if err != nil {
		t.Fatal(err)
	}
	fd := os.NewFile(uintptr(dupped), "dup")
	first.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	waited := false
	if _, err := Acquire(ctx, path, func() { waited = true }); err == nil {
		t.Fatal("acquired a fence held through a duplicated descriptor")
	}
	if !waited {
		t.Error("onWait was not called")
	}

	fd.Close()
	second, err := Acquire(context.Background(), path, nil)
	if err != nil {
		t.Fatalf("fence not free after every holder closed: %v", err)
	}
	second.Close()
}

func TestPathDependsOnStoreAndName(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	a, b, c := Path(dir, "s1", "n"), Path(dir, "s2", "n"), Path(dir, "s1", "m")
	if a == b || a == c || filepath.Dir(a) != dir {
		t.Errorf("paths %q %q %q", a, b, c)
	}
}

func TestHostDirMustBePrivate(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "d")
	if err := checkPrivate(dir); err != nil {
		t.Fatalf("creating it: %v", err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := checkPrivate(dir); err == nil {
		t.Error("accepted a directory open to others")
	}
	link := filepath.Join(t.TempDir(), "link")
	if err := os.Symlink(dir, link); err != nil {
		t.Fatal(err)
	}
	if err := checkPrivate(link); err == nil {
		t.Error("accepted a symlink")
	}
	if HostDir() != filepath.Join("/tmp", "leader-fence-"+strconv.Itoa(os.Getuid())) {
		t.Errorf("HostDir %s", HostDir())
	}
}
