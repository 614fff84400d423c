//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"runtime"
	"runtime/debug"
)

// versionCommand is "leader version", also run by "leader --version" and
// "leader -version".
var versionCommand = &command{
	name:     "version",
	synopsis: "leader version",
	summary:  "print the version of leader and the Go version it was built with",
	help: `
Prints the module version of this leader binary ("(devel)" when it was built
from a source tree rather than installed at a version), then, when the build
recorded them, the version-control revision it was built from, that
revision's time and whether the tree had uncommitted changes, and last the
Go version and platform it was built with:

  leader v1.2.0
    revision  4f1c2e0a9b8d7c6e5f4a3b2c1d0e9f8a7b6c5d4e
    time      2025-05-01T12:00:00Z
    modified  false
    go        go1.26.0 linux/amd64

"leader --version" and "leader -version" print the same.

Exit codes: 0 printed, 2 usage error.
`,
}

func init() {
	versionCommand.flags = func() *flag.FlagSet { return flag.NewFlagSet(versionCommand.name, flag.ContinueOnError) }
	versionCommand.run = runVersion
}

// runVersion prints the version of this binary, from its build information.
func runVersion(a *app, _ context.Context, args []string) int {
	if _, code, ok := a.parse(versionCommand, versionCommand.flags(), args, false); !ok {
		return code
	}
	bi, _ := debug.ReadBuildInfo()
	writeVersion(a.stdout, bi)
	return exitOK
}

// writeVersion writes what "leader version" prints, from bi (nil when the
// binary carries no build information).
func writeVersion(w io.Writer, bi *debug.BuildInfo) {
	version, goVersion := "(unknown)", runtime.Version()
	if bi != nil {
		version, goVersion = bi.Main.Version, bi.GoVersion
		if version == "" {
			version = "(devel)"
		}
	}
	fmt.Fprintf(w, "leader %s\n", version)
	if bi != nil {
		for _, s := range []struct{ key, label string }{
			{"vcs.revision", "revision"},
			{"vcs.time", "time"},
			{"vcs.modified", "modified"},
		} {
			if v := buildSetting(bi, s.key); v != "" {
				fmt.Fprintf(w, "  %-9s %s\n", s.label, v)
			}
		}
	}
	fmt.Fprintf(w, "  %-9s %s %s/%s\n", "go", goVersion, runtime.GOOS, runtime.GOARCH)
}

// buildSetting returns the value of bi's setting key, or "".
func buildSetting(bi *debug.BuildInfo, key string) string {
	for _, s := range bi.Settings {
		if s.Key == key {
			return s.Value
		}
	}
	return ""
}
