//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

// Command leader runs any program as a singleton: among all the instances of
// "leader run" started with one election name, on one host or many, exactly
// one runs its command at a time, and another takes over when it dies or
// steps down. See "leader help" for the subcommands, or usage.go.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/leaderelect/leader/cmd/leader/internal/supervise"
)

func main() {
	os.Exit(dispatch(os.Args[1:]))
}

// dispatch runs the subcommand named by args[0] and returns the exit code.
func dispatch(args []string) int {
	if len(args) > 0 && args[0] == supervise.Subcommand {
		return supervise.Main(args[1:])
	}
	a := &app{stdout: os.Stdout, stderr: os.Stderr, lookupEnv: os.LookupEnv}
	if len(args) == 0 {
		fmt.Fprint(a.stderr, mainUsage)
		return exitUsage
	}
	name, rest := args[0], args[1:]
	switch name {
	case "help", "-h", "-help", "--help":
		return a.help(rest)
	case "--version", "-version":
		return runVersion(a, context.Background(), rest)
	}
	cmd := lookupCommand(name)
	if cmd == nil {
		fmt.Fprintf(a.stderr, "leader: unknown command %q\nRun 'leader help' for the list of commands.\n", name)
		return exitUsage
	}
	// SIGINT and SIGTERM end ctx; each subcommand stops cleanly on it. A
	// second signal is left to the subcommand (run: kill the command at
	// once).
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return cmd.run(a, ctx, rest)
}

// ignoreJobControl makes this process ignore the terminal's job-control
// stops: SIGTSTP (Ctrl-Z), and SIGTTIN and SIGTTOU (reading, or with
// "stty tostop" writing, the terminal from a background job). "leader run"
// and "leader once" call it: a frozen leader process cannot act on the loss
// of its lease, and Ctrl-Z would stop it but not its command, which runs in
// a process group of its own. The command still gets these signals with
// their default action (see package supervise). SIGSTOP cannot be ignored;
// the supervisor's deadline covers it.
func ignoreJobControl() {
	signal.Ignore(syscall.SIGTSTP, syscall.SIGTTIN, syscall.SIGTTOU)
}

// app is what every subcommand writes to and reads from; tests of the
// parsing helpers swap them.
type app struct {
	stdout    io.Writer
	stderr    io.Writer
	lookupEnv func(string) (string, bool)
}

// command is one subcommand.
type command struct {
	name     string
	synopsis string // one line: "leader run --name NAME [flags] -- CMD [ARGS...]"
	summary  string // for "leader help"
	help     string // the long description, after the synopsis
	hidden   bool
	// runsCommand is set when it takes "-- CMD [ARGS...]" after its flags:
	// shell completion then completes CMD as a command.
	runsCommand bool
	// args lists the words its one positional argument may be, for shell
	// completion; nil when it takes none.
	args []string
	// flags returns the subcommand's flags, bound to fresh options; help
	// uses it to list them.
	flags func() *flag.FlagSet
	run   func(a *app, ctx context.Context, args []string) int
}

// commands lists the subcommands in the order "leader help" shows them.
// (Initialised in init to break the reference cycle with help.)
var commands []*command

func init() {
	commands = []*command{runCommand, onceCommand, statusCommand, watchCommand, transferCommand, migrateCommand, demoCommand, versionCommand, completionCommand, demoChildCommand}
}

func lookupCommand(name string) *command {
	for _, c := range commands {
		if c.name == name {
			return c
		}
	}
	return nil
}

func (a *app) help(args []string) int {
	if len(args) == 0 {
		fmt.Fprint(a.stdout, mainUsage)
		return exitOK
	}
	cmd := lookupCommand(args[0])
	if cmd == nil || cmd.hidden {
		fmt.Fprintf(a.stderr, "leader: unknown command %q\nRun 'leader help' for the list of commands.\n", args[0])
		return exitUsage
	}
	printCommandUsage(a.stdout, cmd, cmd.flags())
	return exitOK
}
