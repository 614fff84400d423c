//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/leaderelect/leader/cmd/leader/internal/redact"
)

// Exit codes. The subcommands that run no command (status, watch, migrate,
// demo, version, completion) use exitFailure and exitUsage. "leader run" and
// "leader once" pass their command's exit code through, so their own
// failures use the codes that timeout(1), env(1) and "docker run" use, which
// a command seldom does: exitLeaderError for any failure of leader itself,
// exitCannotExecute and exitNotFound for a command that could not be started.
const (
	exitOK            = 0
	exitFailure       = 1   // a runtime error: the store cannot be opened or reached
	exitUsage         = 2   // bad flags or arguments; nothing was started
	exitLeaderError   = 125 // run, once: leader itself failed (usage or runtime error)
	exitCannotExecute = 126 // run, once: the command was found but could not be executed
	exitNotFound      = 127 // run, once: the command was not found
)

// envStore names the environment variable read when --store is not given.
const envStore = "LEADER_STORE"

// usageError is a mistake in the command line, reported with exit code 2.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error {
	return &usageError{msg: fmt.Sprintf(format, args...)}
}

// fail reports err for subcommand cmd, secrets masked, and returns the exit
// code: exitLeaderError for a subcommand that runs a command (its own exit
// codes are the command's), else exitUsage for a usageError and exitFailure
// for any other.
func (a *app) fail(cmd string, red *redact.Redactor, err error) int {
	msg := red.Error(err)
	var ue *usageError
	usage := errors.As(err, &ue)
	if usage {
		fmt.Fprintf(a.stderr, "leader %s: %s\nRun 'leader %s -h' for usage.\n", cmd, msg, cmd)
	} else {
		fmt.Fprintf(a.stderr, "leader %s: %s\n", cmd, msg)
	}
	switch c := lookupCommand(cmd); {
	case c != nil && c.runsCommand:
		return exitLeaderError
	case usage:
		return exitUsage
	default:
		return exitFailure
	}
}

// parse parses args for cmd with fs, and refuses a duration flag that is
// not positive. When withCommand is set, args must end with
// "-- CMD [ARGS...]", which is returned. ok is false when the caller
// must return code at once: after -h (code 0) or a usage error (code 2, the
// message printed).
func (a *app) parse(cmd *command, fs *flag.FlagSet, args []string, withCommand bool) (command []string, code int, ok bool) {
	flagArgs := args
	dash := slices.Index(args, "--")
	if withCommand && dash >= 0 {
		flagArgs, command = args[:dash], args[dash+1:]
	}
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	if err := fs.Parse(flagArgs); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			printCommandUsage(a.stdout, cmd, fs)
			return nil, exitOK, false
		}
		return nil, a.fail(cmd.name, nil, usagef("%s", flagError(err))), false
	}
	if err := checkDurations(fs); err != nil {
		return nil, a.fail(cmd.name, nil, err), false
	}
	extra := fs.Args()
	switch {
	case withCommand && dash < 0 && len(extra) > 0:
		return nil, a.fail(cmd.name, nil, usagef("put \"--\" before the command to run: leader %s [flags] -- %s", cmd.name, strings.Join(extra, " "))), false
	case withCommand && dash < 0:
		return nil, a.fail(cmd.name, nil, usagef("missing the command to run: leader %s [flags] -- CMD [ARGS...]", cmd.name)), false
	case withCommand && len(command) == 0:
		return nil, a.fail(cmd.name, nil, usagef("missing the command to run after \"--\"")), false
	case len(extra) > 0:
		return nil, a.fail(cmd.name, nil, usagef("unexpected argument %q", extra[0])), false
	}
	return command, exitOK, true
}

// checkDurations refuses a duration flag given on the command line as zero
// or less. Every duration flag is a length of time that must pass; none
// takes zero to mean its default, which help shows instead.
func checkDurations(fs *flag.FlagSet) error {
	var err error
	fs.Visit(func(f *flag.Flag) {
		g, ok := f.Value.(flag.Getter)
		if !ok || err != nil {
			return
		}
		if d, ok := g.Get().(time.Duration); ok && d <= 0 {
			err = usagef("--%s must be positive, got %v", f.Name, d)
		}
	})
	return err
}

// flagError rewrites the flag package's messages to name flags as the help
// text does (--name, not -name).
func flagError(err error) string {
	msg := err.Error()
	for _, prefix := range []string{"flag provided but not defined: -", "flag needs an argument: -", " for flag -"} {
		if i := strings.Index(msg, prefix); i >= 0 && !strings.HasPrefix(msg[i+len(prefix):], "-") {
			msg = msg[:i+len(prefix)] + "-" + msg[i+len(prefix):]
		}
	}
	return msg
}

// commonOptions are the flags every subcommand that talks to a store has.
type commonOptions struct {
	store     string
	logFormat string
	logLevel  string
}

func (c *commonOptions) register(fs *flag.FlagSet, defaultLevel string) {
	fs.StringVar(&c.store, "store", "", "the store's `URL`: postgres://… (or postgresql://…) for instances on several hosts,\n"+
		"or file:///dir for the embedded store, for instances on one host")
	describeDefault(fs, "store", "$"+envStore+"; one of the two is required")
	fs.StringVar(&c.logFormat, "log-format", "text", "log format on stderr: text or json")
	fs.StringVar(&c.logLevel, "log-level", defaultLevel, "log level: debug, info, warn or error")
}

// requiredString is a string flag with no default: help says "(required)"
// where other flags show their default. The subcommands check that it was
// given, each with a message of its own.
type requiredString string

// String returns the flag's value, "" until it is given.
func (s *requiredString) String() string {
	if s == nil {
		return ""
	}
	return string(*s)
}

// Set stores the value given on the command line.
func (s *requiredString) Set(v string) error {
	*s = requiredString(v)
	return nil
}

// describeDefault sets the default that help shows for the flag name of fs,
// for a flag whose zero value stands for something else: a value computed
// from other flags or found at run time.
func describeDefault(fs *flag.FlagSet, name, text string) {
	fs.Lookup(name).DefValue = text
}

// defaultNote is how help shows f's default: "(required)" for a flag that
// has none, "(default: none)" for an empty string, else the default as text
// (false for a boolean, 2m0s for a duration).
func defaultNote(f *flag.Flag) string {
	if _, ok := f.Value.(*requiredString); ok {
		return "(required)"
	}
	if f.DefValue == "" {
		return "(default: none)"
	}
	return "(default: " + f.DefValue + ")"
}

// storeURL returns the store named by --store, else by $LEADER_STORE. No
// subcommand but demo picks a store by itself: which store is named decides
// which instances elect one leader (every host that reaches a database, or
// this host alone), so naming none, or an empty one, is a usage error that
// offers both (see noStoreError). fs is c's parsed flag set.
func (c *commonOptions) storeURL(a *app, fs *flag.FlagSet) (string, error) {
	given := false
	fs.Visit(func(f *flag.Flag) { given = given || f.Name == "store" })
	if given {
		if c.store == "" {
			return "", noStoreError("--store is empty")
		}
		return c.store, nil
	}
	v, set := a.lookupEnv(envStore)
	switch {
	case !set:
		return "", noStoreError("no store named (--store URL, or $" + envStore + ")")
	case v == "":
		return "", noStoreError("$" + envStore + " is empty, and no --store is given")
	}
	return v, nil
}

// noStoreError is the usage error for a missing store: why, then the two
// kinds of store to choose from, with the embedded store's URL in the
// default per-user directory as an example.
func noStoreError(why string) error {
	example := "file:///path/to/dir"
	if dir, err := defaultStoreDir(); err == nil {
		example = (&url.URL{Scheme: "file", Path: dir}).String()
	}
	return usagef("%s; the store decides which instances elect one leader:\n"+
		"  %-40s  instances on many hosts share one PostgreSQL database\n"+
		"  %-40s  instances on this host only (the embedded store)",
		why, "postgres://user:password@host:5432/db", example)
}

// logger returns the logger the options ask for, writing to w, with secrets
// masked by red.
func (c *commonOptions) logger(w io.Writer, red *redact.Redactor) (*slog.Logger, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(c.logLevel)); err != nil {
		return nil, usagef("--log-level %q: want debug, info, warn or error", c.logLevel)
	}
	opts := &slog.HandlerOptions{Level: level, ReplaceAttr: red.ReplaceAttr}
	switch c.logFormat {
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	default:
		return nil, usagef("--log-format %q: want text or json", c.logFormat)
	}
}

// printCommandUsage writes cmd's help: synopsis, description, and every
// flag with its default.
func printCommandUsage(w io.Writer, cmd *command, fs *flag.FlagSet) {
	fmt.Fprintf(w, "Usage: %s\n\n%s\n", cmd.synopsis, strings.TrimSpace(cmd.help))
	var b strings.Builder
	fs.VisitAll(func(f *flag.Flag) {
		typ, usage := flag.UnquoteUsage(f)
		fmt.Fprintf(&b, "  --%s", f.Name)
		if typ != "" {
			fmt.Fprintf(&b, " %s", typ)
		}
		b.WriteString("\n")
		for line := range strings.SplitSeq(usage, "\n") {
			fmt.Fprintf(&b, "        %s\n", line)
		}
		fmt.Fprintf(&b, "        %s\n", defaultNote(f))
	})
	if b.Len() > 0 {
		fmt.Fprintf(w, "\nFlags:\n%s", b.String())
	}
}
