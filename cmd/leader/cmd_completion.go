//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strings"
)

// completionCommand is "leader completion SHELL".
var completionCommand = &command{
	name:     "completion",
	synopsis: "leader completion bash|zsh|fish",
	summary:  "print a shell completion script for leader's subcommands and flags",
	help: `
Prints a script that completes leader's subcommands, each subcommand's
flags, the command after "--" for run and once, and the arguments of help
and completion, in the shell named: bash, zsh or fish. The script is drawn
from this binary's own commands, so it matches its version. To load it:

  bash   in ~/.bashrc:  source <(leader completion bash)
         or save it as ~/.local/share/bash-completion/completions/leader
  zsh    in ~/.zshrc, after compinit:  source <(leader completion zsh)
         or save it as _leader in a directory of $fpath
  fish   leader completion fish > ~/.config/fish/completions/leader.fish

Exit codes: 0 printed, 2 usage error (the shell is missing or unknown).
`,
}

// completionShells are the shells "leader completion" writes a script for,
// in the order its messages name them.
var completionShells = []struct {
	name  string
	write func(w io.Writer, cmds []completionEntry)
}{
	{"bash", writeBashCompletion},
	{"zsh", writeZshCompletion},
	{"fish", writeFishCompletion},
}

func init() {
	completionCommand.flags = func() *flag.FlagSet { return flag.NewFlagSet(completionCommand.name, flag.ContinueOnError) }
	completionCommand.run = runCompletion
	for _, sh := range completionShells {
		completionCommand.args = append(completionCommand.args, sh.name)
	}
}

// runCompletion writes the completion script for the shell named by
// args[0], or reports a missing or unknown shell as a usage error.
func runCompletion(a *app, _ context.Context, args []string) int {
	shell, rest := "", args
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		shell, rest = args[0], args[1:]
	}
	if _, code, ok := a.parse(completionCommand, completionCommand.flags(), rest, false); !ok {
		return code
	}
	choices := "want " + strings.Join(completionCommand.args[:len(completionCommand.args)-1], ", ") +
		" or " + completionCommand.args[len(completionCommand.args)-1]
	if shell == "" {
		return a.fail(completionCommand.name, nil, usagef("missing the shell: %s", choices))
	}
	for _, sh := range completionShells {
		if sh.name == shell {
			sh.write(a.stdout, completionEntries())
			return exitOK
		}
	}
	return a.fail(completionCommand.name, nil, usagef("unknown shell %q: %s", shell, choices))
}

// completionEntry is what the completion scripts know of one subcommand.
type completionEntry struct {
	name        string
	summary     string
	flags       []completionFlag
	runsCommand bool
	args        []string
}

// completionFlag is what the completion scripts know of one flag.
type completionFlag struct {
	name       string
	usage      string // its help, on one line
	valueName  string // "" for a boolean flag, which takes no value
	takesValue bool
}

// completionEntries draws the completion scripts' contents from the command
// table, plus help, which dispatch handles itself.
func completionEntries() []completionEntry {
	var entries []completionEntry
	var names []string
	for _, c := range commands {
		if c.hidden {
			continue
		}
		e := completionEntry{name: c.name, summary: c.summary, runsCommand: c.runsCommand, args: c.args}
		c.flags().VisitAll(func(f *flag.Flag) {
			valueName, usage := flag.UnquoteUsage(f)
			usage = strings.Join(strings.Fields(usage), " ")
			boolFlag, ok := f.Value.(interface{ IsBoolFlag() bool })
			takesValue := !ok || !boolFlag.IsBoolFlag()
			e.flags = append(e.flags, completionFlag{name: f.Name, usage: usage, valueName: valueName, takesValue: takesValue})
		})
		entries = append(entries, e)
		names = append(names, c.name)
	}
	return append(entries, completionEntry{name: "help", summary: "show leader's help, or a command's", args: names})
}

// topLevelFlags are the flags "leader" takes in place of a subcommand.
var topLevelFlags = []string{"--help", "--version"}

// writeBashCompletion writes the bash script: a completion function for
// "complete -F", with bash's default completion (file names) for flag
// values and for the command after "--".
func writeBashCompletion(w io.Writer, entries []completionEntry) {
	var names []string
	for _, e := range entries {
		names = append(names, e.name)
	}
	fmt.Fprintf(w, `# bash completion for leader, written by "leader completion bash".
# Load it with: source <(leader completion bash)

_leader() {
    local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]} i
    COMPREPLY=()
    if ((COMP_CWORD == 1)); then
        if [[ $cur == -* ]]; then
            COMPREPLY=($(compgen -W %s -- "$cur"))
        else
            COMPREPLY=($(compgen -W %s -- "$cur"))
        fi
        return 0
    fi
    # After "--" comes the command to run: bash's default completion.
    for ((i = 2; i < COMP_CWORD; i++)); do
        [[ ${COMP_WORDS[i]} == -- ]] && return 0
    done
    local flags= valued= args=
    case ${COMP_WORDS[1]} in
`, shellQuote(strings.Join(topLevelFlags, " ")), shellQuote(strings.Join(names, " ")))
	for _, e := range entries {
		var flags, valued []string
		for _, f := range e.flags {
			flags = append(flags, "--"+f.name)
			if f.takesValue {
				valued = append(valued, "--"+f.name)
			}
		}
		if e.runsCommand {
			flags = append(flags, "--")
		}
		fmt.Fprintf(w, "    %s)\n", e.name)
		fmt.Fprintf(w, "        flags=%s\n        valued=%s\n        args=%s\n        ;;\n",
			shellQuote(strings.Join(flags, " ")), shellQuote(strings.Join(valued, " ")), shellQuote(strings.Join(e.args, " ")))
	}
	fmt.Fprint(w, `    *)
        return 0
        ;;
    esac
    # A flag's value ("--ttl 5s", or "--ttl=5s", which bash splits at "="):
    # bash's default completion.
    if [[ $prev == = || " $valued " == *" $prev "* ]]; then
        return 0
    fi
    if [[ $cur == -* || -z $args ]]; then
        COMPREPLY=($(compgen -W "$flags" -- "$cur"))
    elif ((COMP_CWORD == 2)); then
        COMPREPLY=($(compgen -W "$args" -- "$cur"))
    fi
    return 0
}

complete -o default -F _leader leader
`)
}

// writeZshCompletion writes the zsh script: a completion function that
// works both when sourced (it registers itself with compdef) and when
// autoloaded from a file _leader in $fpath.
func writeZshCompletion(w io.Writer, entries []completionEntry) {
	fmt.Fprint(w, `#compdef leader
# zsh completion for leader, written by "leader completion zsh".
# Load it with: source <(leader completion zsh), after compinit.

_leader() {
    local -a commands
    commands=(
`)
	for _, e := range entries {
		fmt.Fprintf(w, "        %s\n", shellQuote(strings.ReplaceAll(e.name, ":", `\:`)+":"+e.summary))
	}
	fmt.Fprintf(w, `    )
    if ((CURRENT == 2)); then
        if [[ $PREFIX == -* ]]; then
            compadd -- %s
        else
            _describe -t commands 'leader command' commands
        fi
        return
    fi
    local cmd=$words[2]
    shift words
    ((CURRENT--))
    case $cmd in
`, strings.Join(topLevelFlags, " "))
	for _, e := range entries {
		var specs []string
		for _, f := range e.flags {
			desc := zshEscape(f.usage)
			if !f.takesValue {
				specs = append(specs, shellQuote("--"+f.name+"["+desc+"]"))
				continue
			}
			// --flag= takes its value in the next word or after "=".
			specs = append(specs, shellQuote("--"+f.name+"=["+desc+"]:"+strings.ReplaceAll(f.valueName, ":", `\:`)+": "))
		}
		if len(e.args) > 0 {
			specs = append(specs, shellQuote("1:argument:("+strings.Join(e.args, " ")+")"))
		}
		if e.runsCommand {
			specs = append(specs, shellQuote("*:: :_normal"))
		}
		fmt.Fprintf(w, "    %s)\n", e.name)
		if len(specs) > 0 {
			fmt.Fprintf(w, "        _arguments -S \\\n            %s\n", strings.Join(specs, " \\\n            "))
		}
		fmt.Fprint(w, "        ;;\n")
	}
	fmt.Fprint(w, `    esac
}

if [[ $funcstack[1] == _leader ]]; then
    _leader "$@"
else
    compdef _leader leader
fi
`)
}

// zshEscape escapes s for the description of an _arguments option, between
// brackets.
func zshEscape(s string) string {
	return strings.NewReplacer(`\`, `\\`, `[`, `\[`, `]`, `\]`).Replace(s)
}

// shellQuote quotes s in single quotes for bash or zsh.
func shellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// writeFishCompletion writes the fish script: "complete" commands, with
// conditions on the subcommand in use, and command then file completion
// after "--".
func writeFishCompletion(w io.Writer, entries []completionEntry) {
	fmt.Fprint(w, `# fish completion for leader, written by "leader completion fish".
# Load it with: leader completion fish | source

# __leader_using CMD: the command line names subcommand CMD, and has not
# reached the "--" before the command to run.
function __leader_using
    set -l tokens (commandline -opc)
    test (count $tokens) -ge 2; and test "$tokens[2]" = $argv[1]; and not contains -- -- $tokens
end

# __leader_at_argument CMD: as __leader_using, at CMD's first argument.
function __leader_at_argument
    __leader_using $argv[1]; and test (count (commandline -opc)) -eq 2
end

# __leader_after_dashdash N: the word being completed is the Nth after "--"
# (the command to run is the first), or any after it when N is "rest".
function __leader_after_dashdash
    set -l tokens (commandline -opc)
    set -l i (contains -i -- -- $tokens); or return 1
    set -l n (math (count $tokens) - $i + 1)
    if test $argv[1] = rest
        test $n -gt 1
    else
        test $n -eq $argv[1]
    end
end

complete -c leader -f
`)
	const first = "'test (count (commandline -opc)) -eq 1'"
	for _, e := range entries {
		fmt.Fprintf(w, "complete -c leader -n %s -a %s -d %s\n", first, e.name, fishQuote(e.summary))
	}
	for _, f := range topLevelFlags {
		fmt.Fprintf(w, "complete -c leader -n %s -l %s\n", first, strings.TrimPrefix(f, "--"))
	}
	runsCommand := false
	for _, e := range entries {
		var b strings.Builder
		for _, f := range e.flags {
			value := ""
			if f.takesValue {
				value = " -r"
			}
			fmt.Fprintf(&b, "complete -c leader -n '__leader_using %s' -l %s%s -d %s\n", e.name, f.name, value, fishQuote(f.usage))
		}
		if len(e.args) > 0 {
			fmt.Fprintf(&b, "complete -c leader -n '__leader_at_argument %s' -a %s\n", e.name, fishQuote(strings.Join(e.args, " ")))
		}
		if b.Len() > 0 {
			fmt.Fprintf(w, "\n%s", b.String())
		}
		runsCommand = runsCommand || e.runsCommand
	}
	if runsCommand {
		fmt.Fprint(w, `
complete -c leader -n '__leader_after_dashdash 1' -a '(__fish_complete_command)'
complete -c leader -n '__leader_after_dashdash rest' -F
`)
	}
}

// fishQuote quotes s in single quotes for fish.
func fishQuote(s string) string {
	return "'" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(s) + "'"
}
