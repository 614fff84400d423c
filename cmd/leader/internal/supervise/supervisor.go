//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package supervise

import (
	"bufio"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/leaderelect/leader/cmd/leader/internal/fence"
)

// groupPoll is how often the supervisor checks whether the command's process
// group still has members once the command itself has exited: members that
// are not its children end without telling it.
const groupPoll = 10 * time.Millisecond

// Main is the supervisor: the hidden subcommand Subcommand. args are the
// arguments after the subcommand's name. It returns the process exit code,
// which is 0 unless the supervisor was misused; the command's own exit status
// goes to the leader on the status pipe.
func Main(args []string) int {
	// On Linux the command's parent-death signal is tied to the thread that
	// forks it; this goroutine keeps its thread until the process exits.
	runtime.LockOSThread()

	fs := flag.NewFlagSet(Subcommand, flag.ContinueOnError)
	grace := fs.Duration("grace", 10*time.Second, "time between SIGTERM and SIGKILL")
	fencePath := fs.String("fence", "", "fd 5 is the fence at this `path`, to hold until the group is gone")
	until := fs.Int64("until", 0, "the deadline: CLOCK_MONOTONIC nanoseconds (see Deadline)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	argv := fs.Args()
	if len(argv) == 0 || *until <= 0 {
		fmt.Fprintln(os.Stderr, "leader: "+Subcommand+" is internal to the leader command and needs a command and a deadline")
		return 2
	}
	deadline := Deadline(*until)

	control := os.NewFile(fdControl, "control")
	status := os.NewFile(fdStatus, "status")
	if control == nil || status == nil {
		fmt.Fprintln(os.Stderr, "leader: "+Subcommand+" is internal to the leader command")
		return 2
	}
	// None of these may leak into the command: the control pipe's write end
	// must be held by the leader alone, and the fence by this process alone.
	syscall.CloseOnExec(fdControl)
	syscall.CloseOnExec(fdStatus)
	// The hold of the fence ends here, once the command's group is gone
	// (or the command did not start): release removes the fence file.
	var fenceFile *os.File
	if *fencePath != "" {
		syscall.CloseOnExec(fdFence)
		fenceFile = os.NewFile(fdFence, *fencePath)
	}
	releaseFence := func() {
		if fenceFile != nil {
			_ = fence.Release(fenceFile)
			fenceFile = nil
		}
	}
	defer releaseFence()
	report := func(format string, a ...any) {
		_, _ = fmt.Fprintf(status, format+"\n", a...)
	}

	// The leader decides how the command stops: a terminal's signals are not
	// for us. SIGTERM (for example from a service manager stopping the whole
	// control group) is taken as "stop".
	// Ignored signals are inherited across exec, so the command gets its
	// dispositions from restoreForCommand, not from these.
	restore := restoreForCommand()
	signal.Ignore(syscall.SIGINT, syscall.SIGHUP, syscall.SIGQUIT, syscall.SIGPIPE)
	terms := make(chan os.Signal, 1)
	signal.Notify(terms, syscall.SIGTERM)
	children := make(chan os.Signal, 1)
	signal.Notify(children, syscall.SIGCHLD)

	if err := becomeSubreaper(); err != nil {
		fmt.Fprintf(os.Stderr, "leader: supervisor: cannot become a child subreaper (%v); grandchildren that outlive the command may be missed\n", err)
	}

	path, err := exec.LookPath(argv[0])
	if err != nil {
		code := 127
		if !errors.Is(err, exec.ErrNotFound) && !errors.Is(err, os.ErrNotExist) {
			code = 126
		}
		report("error %d cannot run %q: %v", code, argv[0], unwrapExecErr(err))
		return 0
	}
	devnull, err := os.Open(os.DevNull)
	if err != nil {
		report("error 1 %v", err)
		return 0
	}
	// The dead-man's switch is armed before the command starts, and a
	// command whose deadline has passed (its leader froze meanwhile) is not
	// started at all.
	left, err := deadline.until()
	if err != nil {
		report("error 1 reading the monotonic clock: %v", err)
		return 0
	}
	if left <= 0 {
		report(reportLate)
		return 0
	}
	deadlineTimer := time.NewTimer(left)
	proc, err := startCommand(path, argv, devnull, restore)
	devnull.Close()
	if err != nil {
		code := 126
		if errors.Is(err, os.ErrNotExist) {
			code = 127
		}
		report("error %d cannot run %q: %v", code, argv[0], unwrapExecErr(err))
		return 0
	}
	pid := proc.Pid
	// This process reaps with wait4 itself (it must, as a subreaper on
	// Linux).
	_ = proc.Release()
	report("pid %d", pid)

	fromLeader := make(chan string, 4)
	go readControl(control, fromLeader)

	var (
		exited   *syscall.WaitStatus
		expired  bool // the deadline passed: stopped for it
		stopping bool
		killed   bool
		killAt   <-chan time.Time
		poll     *time.Ticker
		pollC    <-chan time.Time
	)
	kill := func() {
		if !killed {
			killed = true
			_ = syscall.Kill(-pid, syscall.SIGKILL)
		}
	}
	stop := func() {
		if stopping || killed {
			return
		}
		stopping = true
		_ = syscall.Kill(-pid, syscall.SIGTERM)
		_ = syscall.Kill(-pid, syscall.SIGCONT)
		if *grace <= 0 {
			kill()
			return
		}
		killAt = time.After(*grace)
	}
	reap := func() {
		for {
			var ws syscall.WaitStatus
			got, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
			if err == syscall.EINTR {
				continue
			}
			if err != nil || got <= 0 {
				return
			}
			if got == pid {
				exited = &ws
			}
		}
	}
	// checkDeadline stops the command if its deadline has passed, and
	// otherwise sets the timer for it.
	checkDeadline := func() {
		if stopping || killed {
			return
		}
		left, err := deadline.until()
		if err == nil && left > 0 {
			deadlineTimer.Reset(left)
			return
		}
		expired = true
		fmt.Fprintf(os.Stderr, "leader: supervisor: the leader did not extend the command's deadline (it is frozen or cannot renew its lease): stopping the command\n")
		stop()
	}
	for {
		select {
		case <-children:
			reap()
		case msg := <-fromLeader:
			verb, arg, _ := strings.Cut(msg, " ")
			switch verb {
			case msgUntil:
				if d, err := strconv.ParseInt(arg, 10, 64); err == nil && Deadline(d) > deadline {
					deadline = Deadline(d)
				}
				checkDeadline()
			case msgStop:
				stop()
			default: // msgKill, or the leader is gone
				kill()
			}
		case <-deadlineTimer.C:
			checkDeadline()
		case <-terms:
			stop()
		case <-killAt:
			kill()
		case <-pollC:
			reap()
		}
		if exited == nil {
			continue
		}
		if groupAlive(pid) {
			// The command is gone but left processes in its group: stop
			// them as if asked to, and watch for the group to empty.
			stop()
			if poll == nil {
				poll = time.NewTicker(groupPoll)
				pollC = poll.C
			}
			continue
		}
		// Before the report: the leader may ask for the fence again as
		// soon as it reads it, and should find the file gone, not wait
		// for this process to let go of it.
		releaseFence()
		suffix := ""
		if expired {
			suffix = " " + reportDeadline
		}
		switch {
		case exited.Signaled():
			report("signal %d%s", int(exited.Signal()), suffix)
		default:
			report("exit %d%s", exited.ExitStatus(), suffix)
		}
		return 0
	}
}

// commandSignals are the signals whose disposition the supervisor sets for
// itself but must not pass on to the command: the leader process ignores
// the job-control stops (so that Ctrl-Z cannot freeze it), the supervisor
// ignores the terminal's signals, and ignored signals stay ignored across
// exec.
var commandSignals = []os.Signal{
	syscall.SIGTSTP, syscall.SIGTTIN, syscall.SIGTTOU,
	syscall.SIGINT, syscall.SIGHUP, syscall.SIGQUIT, syscall.SIGPIPE,
}

// jobControlSignals always have their default action in the command, as
// job control expects, whatever the leader process does with them.
var jobControlSignals = map[os.Signal]bool{syscall.SIGTSTP: true, syscall.SIGTTIN: true, syscall.SIGTTOU: true}

// restoreForCommand returns the signals of commandSignals that the command
// must get with their default action: the job-control signals, and the
// others unless this process was started with them ignored (by nohup, for
// example, which the command should inherit). Call it before ignoring any.
func restoreForCommand() []os.Signal {
	var out []os.Signal
	for _, sig := range commandSignals {
		if jobControlSignals[sig] || !signal.Ignored(sig) {
			out = append(out, sig)
		}
	}
	return out
}

// startCommand starts the command. The signals in restore get their default
// action in it: for the instant of the fork the supervisor catches them
// (the Go runtime resets caught signals to their default in a new process,
// but leaves ignored ones ignored), then ignores them again. Only the
// job-control signals and the terminal's are ignored here, and nothing the
// supervisor does in that instant raises them.
func startCommand(path string, argv []string, stdin *os.File, restore []os.Signal) (*os.Process, error) {
	if len(restore) > 0 {
		caught := make(chan os.Signal, 1)
		signal.Notify(caught, restore...)
		defer func() {
			signal.Ignore(restore...)
			signal.Stop(caught)
		}()
	}
	return os.StartProcess(path, argv, &os.ProcAttr{
		Env:   os.Environ(),
		Files: []*os.File{stdin, os.Stdout, os.Stderr},
		Sys:   commandAttr(),
	})
}

// readControl forwards the leader's messages; end-of-file (or any error)
// means the leader is gone and is forwarded as "kill".
func readControl(f *os.File, out chan<- string) {
	r := bufio.NewReader(f)
	for {
		line, err := readLine(r)
		if err != nil {
			if !errors.Is(err, io.EOF) {
				fmt.Fprintf(os.Stderr, "leader: supervisor: reading from the leader: %v\n", err)
			}
			out <- msgKill
			return
		}
		out <- line
	}
}

// groupAlive reports whether process group pgid has any member (on Linux,
// zombies included).
func groupAlive(pgid int) bool {
	err := syscall.Kill(-pgid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}

func unwrapExecErr(err error) error {
	var pe *os.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	var ee *exec.Error
	if errors.As(err, &ee) {
		return ee.Err
	}
	return err
}
