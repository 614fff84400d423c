//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package fence

import (
	"context"
	"os"
	"path/filepath"
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
