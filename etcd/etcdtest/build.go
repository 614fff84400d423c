//go:build unix

package etcdtest

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
)

const (
	// modulePath is the module that holds the member program and this
	// package.
	modulePath = "github.com/leaderelect/leader/etcd"

	// memberPackage is the member program's package.
	memberPackage = modulePath + "/internal/etcdserver"

	// buildDirPrefix starts the name of a build directory in the system's
	// temporary directory; the ID of the process that built it follows.
	buildDirPrefix = "leader-etcdtest-bin-"
)

// built holds the result of the one build per test binary.
var built struct {
	once sync.Once
	path string
	err  error
}

// Build builds the member program, the first time it is called in a test
// binary, and returns the path of the executable. It fails t if the build
// fails, then and on every later call.
//
// The go command on PATH (go test puts its own first) builds the program
// from the module github.com/leaderelect/leader/etcd, in that module's
// directory and with GOWORK=off: the member is built with the module's own
// go.mod whether or not a go.work at the repository root is in use, so
// tests of any module in the repository can call Build.
//
// The executable goes in a new directory in the system's temporary
// directory, whose name holds the test binary's process ID. Nothing
// removes it when the test binary ends, as a package cannot hook the end
// of a test binary; instead Build removes the directories of processes
// that no longer exist, so that at most one directory per test binary
// running at the time stays behind.
func Build(t testing.TB) string {
	t.Helper()
	built.once.Do(func() { built.path, built.err = buildMember() })
	if built.err != nil {
		t.Fatalf("etcdtest: building the etcd member program: %v", built.err)
	}
	return built.path
}

func buildMember() (string, error) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		return "", err
	}
	modDir, err := moduleDir(goBin)
	if err != nil {
		return "", err
	}
	removeStaleBuilds()
	dir, err := os.MkdirTemp("", buildDirPrefix+strconv.Itoa(os.Getpid())+"-")
	if err != nil {
		return "", err
	}
	exe := filepath.Join(dir, "etcdserver")
	cmd := exec.Command(goBin, "build", "-o", exe, memberPackage)
	cmd.Dir = modDir
	cmd.Env = append(os.Environ(), "GOWORK=off")
	if out, err := cmd.CombinedOutput(); err != nil {
		os.RemoveAll(dir)
		return "", fmt.Errorf("go build %s in %s: %v\n%s", memberPackage, modDir, err, out)
	}
	return exe, nil
}

// moduleDir returns the directory of the module github.com/leaderelect/
// leader/etcd: the parent of this file's directory, as the compiler
// recorded it, if that holds the module's go.mod; else what the go command
// says, asked from the current directory (a test's package directory).
// The second case covers a test binary built with -trimpath.
func moduleDir(goBin string) (string, error) {
	if _, file, _, ok := runtime.Caller(0); ok && filepath.IsAbs(file) {
		dir := filepath.Dir(filepath.Dir(file))
		if goModDeclares(filepath.Join(dir, "go.mod"), modulePath) {
			return dir, nil
		}
	}
	out, err := exec.Command(goBin, "list", "-m", "-f", "{{.Dir}}", modulePath).Output()
	if err != nil {
		var exitErr *exec.ExitError
		if errors.As(err, &exitErr) {
			err = fmt.Errorf("%v: %s", err, exitErr.Stderr)
		}
		return "", fmt.Errorf("finding the directory of module %s: go list -m: %w", modulePath, err)
	}
	dir := strings.TrimSpace(string(out))
	if dir == "" {
		return "", fmt.Errorf("finding the directory of module %s: go list -m names none", modulePath)
	}
	return dir, nil
}

// goModDeclares reports whether the go.mod file at path declares module
// path mod.
func goModDeclares(path, mod string) bool {
	f, err := os.Open(path)
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) == 2 && fields[0] == "module" {
			return strings.Trim(fields[1], `"`) == mod
		}
	}
	return false
}

// removeStaleBuilds removes the build directories whose process no longer
// exists. A process ID reused since only keeps a directory a while longer.
func removeStaleBuilds() {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), buildDirPrefix+"*"))
	for _, dir := range dirs {
		rest := strings.TrimPrefix(filepath.Base(dir), buildDirPrefix)
		pidText, _, ok := strings.Cut(rest, "-")
		if !ok {
			continue
		}
		pid, err := strconv.Atoi(pidText)
		if err != nil || pid <= 0 || pid == os.Getpid() {
			continue
		}
		if err := syscall.Kill(pid, 0); errors.Is(err, syscall.ESRCH) {
			os.RemoveAll(dir)
		}
	}
}
