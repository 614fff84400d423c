//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// run and once never choose a store by themselves: the store decides which
// instances elect one leader, and a default would silently make it this host
// only. Without one, named or empty, they exit 125 and run nothing, and the
// message offers both kinds of store.
func TestRunAndOnceRefuseToStartWithoutAStore(t *testing.T) {
	t.Parallel()
	for _, cmd := range []string{"run", "once"} {
		for _, tt := range []struct {
			name  string
			env   []string // added to the test's environment (which has no LEADER_STORE)
			flags []string
			says  string
		}{
			{"with LEADER_STORE unset", nil, nil, "no store named"},
			{"with LEADER_STORE empty", []string{"LEADER_STORE="}, nil, "$LEADER_STORE is empty"},
			{"with --store empty", nil, []string{"--store", ""}, "--store is empty"},
			{"with --store= empty", nil, []string{"--store="}, "--store is empty"},
			{"with --store empty and LEADER_STORE set", []string{"LEADER_STORE=file:///nowhere"}, []string{"--store", ""}, "--store is empty"},
		} {
			t.Run(cmd+" "+tt.name, func(t *testing.T) {
				t.Parallel()
				e := newEnv(t).with(tt.env...)
				ran := filepath.Join(e.dir, "ran")
				args := append(append([]string{cmd, "--name", "x"}, tt.flags...), "--", "touch", ran)
				_, stderr, code := e.run(args...)
				if code != exitLeaderError {
					t.Errorf("exit code %d, want %d\n%s", code, exitLeaderError, stderr)
				}
				if _, err := os.Stat(ran); err == nil {
					t.Error("the command ran")
				}
				// newEnv sets XDG_STATE_HOME, so the per-user directory is
				// known, and offered.
				suggested := "file://" + filepath.Join(e.dir, "state", "leader")
				for _, want := range []string{tt.says, "postgres://", "many hosts", suggested, "this host only", "Run 'leader " + cmd + " -h'"} {
					if !strings.Contains(stderr, want) {
						t.Errorf("the message does not say %q:\n%s", want, stderr)
					}
				}
				if _, err := os.Stat(filepath.Join(e.dir, "state")); err == nil {
					t.Error("the per-user state directory was created")
				}
			})
		}
	}
}

// status, watch and migrate need a store as well (a usage error, 2), so
// that they cannot show an empty default store while the candidates elect
// on another.
func TestStatusWatchAndMigrateNeedAStore(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{"status", "--name", "x"},
		{"watch", "--name", "x"},
		{"migrate"},
	} {
		t.Run(args[0], func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			_, stderr, code := e.run(args...)
			if code != exitUsage || !strings.Contains(stderr, "no store named") {
				t.Errorf("exit code %d, want %d and a word on the store\n%s", code, exitUsage, stderr)
			}
		})
	}
}

// Without $XDG_STATE_HOME and $HOME there is no per-user directory to
// offer, and none is made up in a temporary directory, where instances with
// different TMPDIRs or a private /tmp would not meet.
func TestNoDefaultStoreDirectoryWithoutHome(t *testing.T) {
	t.Setenv("HOME", "")
	t.Setenv("XDG_STATE_HOME", "")
	if dir, err := defaultStoreDir(); err == nil {
		t.Errorf("defaultStoreDir() = %s without HOME and XDG_STATE_HOME, want an error", dir)
	}
	t.Setenv("XDG_STATE_HOME", "/var/lib/state")
	if dir, err := defaultStoreDir(); err != nil || dir != "/var/lib/state/leader" {
		t.Errorf("defaultStoreDir() = %q, %v with XDG_STATE_HOME=/var/lib/state", dir, err)
	}
}

// The message for a missing store, from a process with neither HOME nor
// XDG_STATE_HOME (a bare service or cron environment), offers no directory
// under the temporary directory.
func TestMissingStoreMessageWithoutHome(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var vars []string
	for _, kv := range e.vars {
		if k, _, _ := strings.Cut(kv, "="); k != "HOME" && k != "XDG_STATE_HOME" {
			vars = append(vars, kv)
		}
	}
	e.vars = vars
	_, stderr, code := e.run("run", "--name", "x", "--", "true")
	if code != exitLeaderError || !strings.Contains(stderr, "file:///path/to/dir") {
		t.Errorf("exit %d, want %d and a placeholder directory\n%s", code, exitLeaderError, stderr)
	}
	if strings.Contains(stderr, "file:///tmp") || strings.Contains(stderr, "file://"+os.TempDir()) {
		t.Errorf("the message offers a temporary directory:\n%s", stderr)
	}
}

// Every start of run and once says, at the default log level, which store
// it elects on and so which instances it competes with.
func TestRunAndOnceLogTheStoreAndScope(t *testing.T) {
	t.Parallel()
	for _, cmd := range []string{"run", "once"} {
		t.Run(cmd, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			dir := filepath.Join(e.dir, "store")
			_, stderr, code := e.run(cmd, "--store", "file://"+dir, "--name", "x", "--", "true")
			if code != 0 {
				t.Fatalf("exit code %d\n%s", code, stderr)
			}
			want := `level=INFO msg=electing store=file://` + dir + ` scope="this host only (embedded store in ` + dir + `)"`
			if !strings.Contains(stderr, want) {
				t.Errorf("no line %q in:\n%s", want, stderr)
			}
		})
	}
}
