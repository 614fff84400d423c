//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// run and once pass their command's exit code through, and keep 125, 126
// and 127 for themselves, as timeout(1), env(1) and "docker run" do; the
// other subcommands, which run no command, keep 2 for usage errors.
func TestExitCodes(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	notExecutable := filepath.Join(e.dir, "not-executable.sh")
	if err := os.WriteFile(notExecutable, []byte("#!/bin/sh\nexit 0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		args []string // after the subcommand and its --store and --name
		want int
	}{
		{"a usage error is 125", []string{"--bogus", "--", "true"}, exitLeaderError},
		{"a zero duration is 125", []string{"--grace", "0s", "--", "true"}, exitLeaderError},
		{"the command's exit code passes through", []string{"--", "sh", "-c", "exit 3"}, 3},
		{"a command not found is 127", []string{"--", filepath.Join(e.dir, "no-such-program")}, exitNotFound},
		{"a command not in PATH is 127", []string{"--", "no-such-program-anywhere"}, exitNotFound},
		{"a command that cannot be executed is 126", []string{"--", notExecutable}, exitCannotExecute},
		{"a directory is 126", []string{"--", e.dir}, exitCannotExecute},
		{"a command ended by signal N is 128+N", []string{"--", "sh", "-c", "kill -USR1 $$"}, 128 + int(syscall.SIGUSR1)},
	}
	for _, cmd := range []string{"run", "once"} {
		for _, tt := range tests {
			t.Run(cmd+": "+tt.name, func(t *testing.T) {
				t.Parallel()
				e := newEnv(t)
				args := append([]string{cmd, "--store", e.fileStore(), "--name", "codes"}, tt.args...)
				_, stderr, code := e.run(args...)
				if code != tt.want {
					t.Errorf("exit code %d, want %d\n%s", code, tt.want, stderr)
				}
			})
		}
	}
	t.Run("a runtime error of run is 125", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		notADir := filepath.Join(e.dir, "file")
		if err := os.WriteFile(notADir, nil, 0o644); err != nil {
			t.Fatal(err)
		}
		for _, cmd := range []string{"run", "once"} {
			_, stderr, code := e.run(cmd, "--store", "file://"+notADir, "--name", "x", "--", "true")
			if code != exitLeaderError || !strings.Contains(stderr, "opening the embedded store") {
				t.Errorf("%s on a store that cannot be opened: exit %d, want %d\n%s", cmd, code, exitLeaderError, stderr)
			}
			_, stderr, code = e.run("status", "--store", "file://"+notADir, "--name", "x")
			if code != exitFailure {
				t.Errorf("status on a store that cannot be opened: exit %d, want %d\n%s", code, exitFailure, stderr)
			}
		}
	})
	t.Run("a usage error of status is 2", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		if _, stderr, code := e.run("status", "--store", e.fileStore(), "--name", "x", "--bogus"); code != exitUsage {
			t.Errorf("exit code %d, want %d\n%s", code, exitUsage, stderr)
		}
	})
}
