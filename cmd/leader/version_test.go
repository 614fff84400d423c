//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"regexp"
	"runtime"
	"runtime/debug"
	"strings"
	"testing"
)

// "leader version" prints the module version, the VCS details the build
// recorded and the Go version, in a fixed line format.
func TestVersion(t *testing.T) {
	t.Parallel()
	platform := runtime.GOOS + "/" + runtime.GOARCH

	t.Run("a build with version control shows the revision, its time and the modified flag", func(t *testing.T) {
		t.Parallel()
		var out strings.Builder
		writeVersion(&out, &debug.BuildInfo{
			GoVersion: "go1.99.1",
			Main:      debug.Module{Path: "github.com/leaderelect/leader", Version: "v1.2.3"},
			Settings: []debug.BuildSetting{
				{Key: "GOOS", Value: runtime.GOOS},
				{Key: "vcs", Value: "git"},
				{Key: "vcs.revision", Value: "0123456789abcdef0123456789abcdef01234567"},
				{Key: "vcs.time", Value: "2025-05-01T12:00:00Z"},
				{Key: "vcs.modified", Value: "true"},
			},
		})
		want := "leader v1.2.3\n" +
			"  revision  0123456789abcdef0123456789abcdef01234567\n" +
			"  time      2025-05-01T12:00:00Z\n" +
			"  modified  true\n" +
			"  go        go1.99.1 " + platform + "\n"
		if out.String() != want {
			t.Errorf("got\n%s\nwant\n%s", out.String(), want)
		}
	})

	t.Run("a build from a source tree without version control says (devel)", func(t *testing.T) {
		t.Parallel()
		var out strings.Builder
		writeVersion(&out, &debug.BuildInfo{GoVersion: "go1.99.1", Main: debug.Module{Path: "github.com/leaderelect/leader"}})
		if want := "leader (devel)\n  go        go1.99.1 " + platform + "\n"; out.String() != want {
			t.Errorf("got\n%s\nwant\n%s", out.String(), want)
		}
	})

	t.Run("a binary without build information still shows the Go version", func(t *testing.T) {
		t.Parallel()
		var out strings.Builder
		writeVersion(&out, nil)
		if want := "leader (unknown)\n  go        " + runtime.Version() + " " + platform + "\n"; out.String() != want {
			t.Errorf("got\n%s\nwant\n%s", out.String(), want)
		}
	})

	t.Run("this test binary's build information reads as such", func(t *testing.T) {
		t.Parallel()
		bi, ok := debug.ReadBuildInfo()
		if !ok {
			t.Fatal("the test binary has no build information")
		}
		var out strings.Builder
		writeVersion(&out, bi)
		checkVersionOutput(t, out.String())
	})

	t.Run("version, --version and -version print the same", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		out, stderr, code := e.run("version")
		if code != exitOK || stderr != "" {
			t.Fatalf("version: exit %d, stderr %q", code, stderr)
		}
		checkVersionOutput(t, out)
		for _, flag := range []string{"--version", "-version"} {
			if got, _, code := e.run(flag); code != exitOK || got != out {
				t.Errorf("%s: exit %d, printed\n%s\nwant\n%s", flag, code, got, out)
			}
		}
		if _, stderr, code := e.run("version", "extra"); code != exitUsage || !strings.Contains(stderr, `unexpected argument "extra"`) {
			t.Errorf("version extra: exit %d, stderr %q", code, stderr)
		}
	})
}

// versionLine is one line of "leader version" after the first.
var versionLine = regexp.MustCompile(`^  (revision  [0-9a-f]+|time      \S+|modified  (true|false)|go        go\S+ \S+/\S+)$`)

// checkVersionOutput checks the line format of "leader version", and that
// it shows the Go version this test was built with.
func checkVersionOutput(t *testing.T, out string) {
	t.Helper()
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	if !regexp.MustCompile(`^leader (\(devel\)|v\S+)$`).MatchString(lines[0]) {
		t.Errorf("first line %q, want \"leader VERSION\"", lines[0])
	}
	for _, l := range lines[1:] {
		if !versionLine.MatchString(l) {
			t.Errorf("line %q is not a version line", l)
		}
	}
	if want := "  go        " + runtime.Version() + " " + runtime.GOOS + "/" + runtime.GOARCH; lines[len(lines)-1] != want {
		t.Errorf("last line %q, want %q", lines[len(lines)-1], want)
	}
}
