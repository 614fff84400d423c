//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package fence

import (
	"context"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
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

// fenceFiles returns the names of the files in dir.
func fenceFiles(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	return names
}

func TestReleaseLeavesNoFileBehind(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	for i := range 100 {
		f, err := Acquire(context.Background(), Path(dir, "file:///x", "job-"+strconv.Itoa(i%7)), nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := Release(f); err != nil {
			t.Fatal(err)
		}
	}
	if left := fenceFiles(t, dir); len(left) != 0 {
		t.Errorf("fence files left after every hold ended: %v", left)
	}
}

// A waiter that opened the fence file before its holder removed it takes
// the lock of a file nobody else can open: it must notice, and take the
// file the path names now, which a third locker then finds held.
func TestAWaiterOnARemovedFenceTakesTheNewOne(t *testing.T) {
	t.Parallel()
	path := Path(t.TempDir(), "file:///x", "job")
	holder, err := Acquire(context.Background(), path, nil)
	if err != nil {
		t.Fatal(err)
	}
	waiting := make(chan struct{})
	type result struct {
		f   *os.File
		err error
	}
	got := make(chan result, 1)
	go func() {
		f, err := Acquire(context.Background(), path, func() { close(waiting) })
		got <- result{f, err}
	}()
	<-waiting
	if err := Release(holder); err != nil {
		t.Fatal(err)
	}
	r := <-got
	if r.err != nil {
		t.Fatal(r.err)
	}
	defer Release(r.f)
	if same, err := names(path, r.f); err != nil || !same {
		t.Fatalf("the waiter holds a file the path does not name (err %v)", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if f, err := Acquire(ctx, path, nil); err == nil {
		f.Close()
		t.Error("a third locker took the fence the waiter holds")
	}
}

// Release removes only the file it holds, not one put in its place.
func TestReleaseLeavesAnotherFileAlone(t *testing.T) {
	t.Parallel()
	path := Path(t.TempDir(), "file:///x", "job")
	f, err := Acquire(context.Background(), path, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := Release(f); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); err != nil {
		t.Errorf("Release removed a file it did not hold: %v", err)
	}
}

// Lockers race each other for one fence, each ending its hold with Release
// (which removes the file) or, now and then, with Close (which leaves it
// for the next): never two inside at once, and no file left at the end.
func TestFenceExcludesWhileHoldersRemoveIt(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := Path(dir, "file:///x", "job")
	const lockers, rounds = 6, 150
	var inside, entered atomic.Int64
	var wg sync.WaitGroup
	for l := range lockers {
		wg.Go(func() {
			for i := range rounds {
				f, err := Acquire(context.Background(), path, nil)
				if err != nil {
					t.Error(err)
					return
				}
				if n := inside.Add(1); n != 1 {
					t.Errorf("%d lockers hold the fence at once", n)
				}
				entered.Add(1)
				runtime.Gosched()
				inside.Add(-1)
				if (l+i)%5 == 0 {
					f.Close()
				} else if err := Release(f); err != nil {
					t.Error(err)
				}
			}
		})
	}
	wg.Wait()
	if n := entered.Load(); n != lockers*rounds {
		t.Errorf("%d holds, want %d", n, lockers*rounds)
	}
	f, err := Acquire(context.Background(), path, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := Release(f); err != nil {
		t.Fatal(err)
	}
	if left := fenceFiles(t, dir); len(left) != 0 {
		t.Errorf("fence files left: %v", left)
	}
}
