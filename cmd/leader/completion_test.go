//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"context"
	"flag"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// completionScript returns what "leader completion shell" prints.
func completionScript(t *testing.T, shell string) string {
	t.Helper()
	var stdout, stderr strings.Builder
	a := &app{stdout: &stdout, stderr: &stderr, lookupEnv: func(string) (string, bool) { return "", false }}
	if code := runCompletion(a, context.Background(), []string{shell}); code != exitOK {
		t.Fatalf("completion %s: exit %d\n%s", shell, code, stderr.String())
	}
	return stdout.String()
}

// completionArm returns the part of a bash or zsh script that completes
// subcommand name: its arm of the case statement.
func completionArm(t *testing.T, script, name string) string {
	t.Helper()
	_, arm, ok := strings.Cut(script, "\n    "+name+")\n")
	if !ok {
		t.Fatalf("no case for %s", name)
	}
	arm, _, _ = strings.Cut(arm, ";;")
	return arm
}

// Each shell's completion script completes every subcommand and each of
// its flags, passes the shell's own syntax check where the shell is
// installed, and, in bash, offers the right words.
func TestCompletion(t *testing.T) {
	t.Parallel()
	// What each shell's script must say for subcommand cmd and its flag f.
	flagPatterns := map[string]func(cmd string, f *flag.Flag) *regexp.Regexp{
		"bash": func(_ string, f *flag.Flag) *regexp.Regexp {
			return regexp.MustCompile(`flags='[^']*--` + regexp.QuoteMeta(f.Name) + `[ ']`)
		},
		"zsh": func(_ string, f *flag.Flag) *regexp.Regexp {
			return regexp.MustCompile(`'--` + regexp.QuoteMeta(f.Name) + `=?\[`)
		},
		"fish": func(cmd string, f *flag.Flag) *regexp.Regexp {
			return regexp.MustCompile(`-n '__leader_using ` + cmd + `' -l ` + regexp.QuoteMeta(f.Name) + ` `)
		},
	}
	for _, shell := range []string{"bash", "zsh", "fish"} {
		t.Run(shell+" completes every subcommand and its flags", func(t *testing.T) {
			t.Parallel()
			script := completionScript(t, shell)
			for _, cmd := range append(commands, &command{name: "help"}) {
				if cmd.hidden {
					continue
				}
				if !regexp.MustCompile(`\b` + cmd.name + `\b`).MatchString(script) {
					t.Errorf("%s is not in the script", cmd.name)
				}
				if cmd.flags == nil {
					continue
				}
				within := script
				if shell != "fish" {
					within = completionArm(t, script, cmd.name)
				}
				cmd.flags().VisitAll(func(f *flag.Flag) {
					if !flagPatterns[shell](cmd.name, f).MatchString(within) {
						t.Errorf("%s --%s is not completed:\n%s", cmd.name, f.Name, within)
					}
				})
			}
		})
	}

	// Each shell checks its script's syntax without running it, where it
	// is installed.
	for shell, check := range map[string][]string{"bash": {"-n"}, "zsh": {"-n"}, "fish": {"--no-execute"}} {
		t.Run(shell+" accepts its script's syntax", func(t *testing.T) {
			t.Parallel()
			path, err := exec.LookPath(shell)
			if err != nil {
				t.Skipf("%s is not installed", shell)
			}
			file := filepath.Join(t.TempDir(), "leader."+shell)
			if err := os.WriteFile(file, []byte(completionScript(t, shell)), 0o644); err != nil {
				t.Fatal(err)
			}
			if out, err := exec.Command(path, append(check, file)...).CombinedOutput(); err != nil {
				t.Errorf("%s %v: %v\n%s", shell, check, err, out)
			}
		})
	}

	t.Run("bash offers what each word can be", func(t *testing.T) {
		t.Parallel()
		bash, err := exec.LookPath("bash")
		if err != nil {
			t.Skip("bash is not installed")
		}
		file := filepath.Join(t.TempDir(), "leader.bash")
		if err := os.WriteFile(file, []byte(completionScript(t, "bash")), 0o644); err != nil {
			t.Fatal(err)
		}
		tests := []struct {
			words string // the command line, the last word being completed
			want  string
		}{
			{"leader ''", "run once status watch transfer migrate demo version completion help"},
			{"leader st", "status"},
			{"leader --v", "--version"},
			{"leader status --j", "--json"},
			{"leader run --name x --gr", "--grace"},
			{"leader run --ttl ''", ""},           // a flag's value: file names
			{"leader run --name x -- ''", ""},     // the command to run: file names
			{"leader run --name x -- ls --t", ""}, // its arguments are not leader's flags
			{"leader help wa", "watch"},
			{"leader completion ''", "bash zsh fish"},
		}
		for _, tt := range tests {
			script := `source "$1"; COMP_WORDS=(` + tt.words + `); COMP_CWORD=$((${#COMP_WORDS[@]} - 1)); _leader; echo "${COMPREPLY[*]}"`
			out, err := exec.Command(bash, "-c", script, "bash", file).CombinedOutput()
			if got := strings.TrimSuffix(string(out), "\n"); err != nil || got != tt.want {
				t.Errorf("%s: offered %q (%v), want %q", tt.words, got, err, tt.want)
			}
		}
	})
}
