//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"flag"
	"strings"
	"testing"
)

// flagHelp splits the Flags section of a command's help into each flag's
// lines, by flag name.
func flagHelp(t *testing.T, help string) map[string]string {
	t.Helper()
	_, section, ok := strings.Cut(help, "\nFlags:\n")
	if !ok {
		return nil
	}
	blocks := map[string]string{}
	var name string
	for line := range strings.SplitSeq(section, "\n") {
		if rest, ok := strings.CutPrefix(line, "  --"); ok {
			name, _, _ = strings.Cut(rest, " ")
		}
		if name == "" {
			t.Fatalf("the Flags section does not start with a flag:\n%s", section)
		}
		blocks[name] += line + "\n"
	}
	return blocks
}

// The help of every subcommand lists each of its flags with its default, or
// says that the flag is required; and each kind of default reads well.
func TestHelpShowsADefaultForEveryFlag(t *testing.T) {
	t.Parallel()
	for _, cmd := range commands {
		if cmd.hidden {
			continue
		}
		t.Run(cmd.name, func(t *testing.T) {
			t.Parallel()
			var out strings.Builder
			printCommandUsage(&out, cmd, cmd.flags())
			blocks := flagHelp(t, out.String())
			cmd.flags().VisitAll(func(f *flag.Flag) {
				block, ok := blocks[f.Name]
				switch {
				case !ok:
					t.Errorf("--%s is not in the help:\n%s", f.Name, out.String())
				case !strings.Contains(block, "(default: ") && !strings.Contains(block, "(required)"):
					t.Errorf("--%s shows no default:\n%s", f.Name, block)
				}
			})
			if len(blocks) != countFlags(cmd.flags()) {
				t.Errorf("the help lists %d flags, the command has %d", len(blocks), countFlags(cmd.flags()))
			}
		})
	}

	t.Run("each kind of default reads as itself", func(t *testing.T) {
		t.Parallel()
		want := map[string]map[string]string{
			"run":    {"ttl": "(default: 15s)", "name": "(required)", "restart": "(default: never)", "grace": "(default: TTL/5 minus the kill margin: 2.75s for the default --ttl)"},
			"once":   {"window": "(default: 2m0s)", "grace": "(default: --window/5 minus a kill margin: 23.75s for the default --window)"},
			"status": {"json": "(default: false)", "store": "(default: $LEADER_STORE; one of the two is required)"},
			"watch":  {"poll": "(default: 2s)"},
			"demo":   {"ttl": "(default: 2s)"},
		}
		for name, flags := range want {
			cmd := lookupCommand(name)
			var out strings.Builder
			printCommandUsage(&out, cmd, cmd.flags())
			blocks := flagHelp(t, out.String())
			for flagName, note := range flags {
				if !strings.Contains(blocks[flagName], note) {
					t.Errorf("%s --%s does not show %q:\n%s", name, flagName, note, blocks[flagName])
				}
			}
		}
	})
}

// countFlags returns how many flags fs defines.
func countFlags(fs *flag.FlagSet) int {
	n := 0
	fs.VisitAll(func(*flag.Flag) { n++ })
	return n
}
