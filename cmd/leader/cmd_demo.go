//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"strings"
	"syscall"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/cmd/leader/internal/redact"
	"github.com/leaderelect/leader/cmd/leader/internal/supervise"
)

var demoCommand = &command{
	name:     "demo",
	synopsis: "leader demo [--store URL] [--strategy S] [--ttl D]",
	summary:  "watch a failover and a handover between three candidates, live",
	help: `
Starts three "leader run" candidates for one election, each wanting to run a
small command that prints a line now and then, and narrates on a timeline:
who is elected; what happens when the leader process is killed with SIGKILL
(its command dies with it, another candidate takes over: the takeover delay
is measured); and what happens when the new leader is stopped gracefully with
SIGTERM (it stops its command, releases the lease, and the next candidate
takes over at once: the handover delay is measured). Then it stops the rest
and cleans up. It takes about ten seconds.

With no --store, it uses the embedded store in a fresh temporary directory,
where a killed leader is replaced at once (the kernel frees its lock). With
--store postgres://…, it creates the schema if needed and uses an election
name of its own; a killed leader is then replaced when its lease runs out,
about --ttl later, which is why the demo's TTL is short. With --strategy
advisory as well, a killed leader is replaced as soon as PostgreSQL notices
that its connection closed.

Exit codes: 0 the demo ran, 1 it could not (for example the store cannot be
reached), 2 usage error.
`,
}

// demoChildCommand is the command the demo's candidates run: a stand-in for
// real work that prints a line now and then and stops on SIGTERM.
var demoChildCommand = &command{name: "__demo-child", hidden: true}

func init() {
	demoCommand.flags = func() *flag.FlagSet { return new(demoOptions).flags() }
	demoCommand.run = runDemo
	demoChildCommand.flags = func() *flag.FlagSet { return flag.NewFlagSet(demoChildCommand.name, flag.ContinueOnError) }
	demoChildCommand.run = runDemoChild
}

type demoOptions struct {
	store    string
	strategy string
	ttl      time.Duration
}

func (o *demoOptions) flags() *flag.FlagSet {
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.StringVar(&o.store, "store", "", "the store's `URL`")
	describeDefault(fs, "store", "the embedded store in a fresh temporary directory ($"+envStore+" is not read)")
	registerStrategy(fs, &o.strategy, "the candidates' PostgreSQL strategy: lease or advisory (see \"leader run -h\")")
	fs.DurationVar(&o.ttl, "ttl", 2*time.Second, "the candidates' lease TTL")
	return fs
}

// demoEvent is one line of the timeline's raw material.
type demoEvent struct {
	at   time.Time
	cand string
	msg  string         // log message, or "output" for the command's output
	attr map[string]any // the log record
	text string         // the command's output line
}

type demoCandidate struct {
	id   string
	cmd  *exec.Cmd
	done chan struct{}
}

type demo struct {
	out   io.Writer
	t0    time.Time
	cands []*demoCandidate
	evs   chan demoEvent
	// state, kept by the loop reading evs
	leader     string
	childPid   map[string]int // candidate -> its command's pid, while it runs
	lastElect  map[string]time.Time
	electCount int
}

func runDemo(a *app, ctx context.Context, args []string) int {
	var o demoOptions
	if _, code, ok := a.parse(demoCommand, o.flags(), args, false); !ok {
		return code
	}
	red := redact.ForURL(o.store)
	fail := func(err error) int { return a.fail("demo", red, err) }

	name := "demo"
	store := o.store
	if store == "" {
		dir, err := os.MkdirTemp("", "leader-demo-")
		if err != nil {
			return fail(err)
		}
		defer os.RemoveAll(dir)
		store = "file://" + dir
	}
	spec, err := parseStoreURL(store)
	if err != nil {
		return fail(err)
	}
	if spec, err = withStrategy(spec, o.strategy); err != nil {
		return fail(err)
	}
	if err := validateConfig(demoConfig(o.ttl)); err != nil {
		return fail(configUsageError(err, o.ttl, defaultGrace(o.ttl)))
	}
	if spec.kind == postgresStore {
		// Create the schema, and use a name of our own so that earlier
		// demos' leases do not matter.
		log, _ := (&commonOptions{logFormat: "text", logLevel: "warn"}).logger(a.stderr, red)
		st, err := openStoreFor(ctx, spec, log, true)
		if err != nil {
			return fail(err)
		}
		err = st.migrate(ctx)
		st.Close()
		if err != nil {
			return fail(fmt.Errorf("creating the schema on %s: %w", spec.display, err))
		}
		// Refuse here, once, a server the candidates would refuse.
		if st, err = openStore(ctx, spec, log); err != nil {
			return fail(err)
		}
		st.Close()
		tok, _ := randomToken()
		name = "demo-" + tok[:6]
	}
	exe, err := supervise.SelfExecutable()
	if err != nil {
		return fail(err)
	}

	// On Linux the candidates get a parent-death signal, tied to the thread
	// that starts them: keep this goroutine on it, so that a demo killed
	// without warning takes its candidates (and so their commands) along.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()

	d := &demo{out: a.stdout, evs: make(chan demoEvent, 256), childPid: map[string]int{}, lastElect: map[string]time.Time{}}
	kind := "the embedded store (a file lock; a dead leader's lock is freed by the kernel at once)"
	switch spec.strategy {
	case strategyLease:
		kind = "PostgreSQL (a dead leader's lease runs out after the TTL)"
	case strategyAdvisory:
		kind = "PostgreSQL, advisory strategy (a dead leader's lock is freed as soon as PostgreSQL notices its connection closed)"
	}
	fmt.Fprintf(a.stdout, "leader demo: three candidates campaign for the election %q on %s\n", name, kind)
	runFlags := fmt.Sprintf("--name %s --ttl %v", name, o.ttl)
	if spec.strategy == strategyAdvisory {
		runFlags += " --strategy " + spec.strategy
	}
	fmt.Fprintf(a.stdout, "store %s, TTL %v; each runs: leader run %s -- <a command that prints a line now and then>\n\n",
		spec.display, o.ttl, runFlags)

	d.t0 = time.Now()
	defer d.cleanup()
	for i := 1; i <= 3; i++ {
		id := fmt.Sprintf("cand-%d", i)
		c, err := d.startCandidate(exe, store, spec.strategy, name, id, o.ttl)
		if err != nil {
			return fail(err)
		}
		d.say(time.Now(), "started candidate %s (pid %d)", id, c.cmd.Process.Pid)
	}

	var afterKill string // what happens to the store when the leader is killed
	switch spec.strategy {
	case strategyLease:
		afterKill = fmt.Sprintf("its command dies with it at once; its lease stays held until it runs out, within the %v TTL", o.ttl)
	case strategyAdvisory:
		afterKill = "its command dies with it at once; PostgreSQL frees its lock as soon as it notices the connection closed"
	}
	res, err := d.script(ctx, o.ttl, afterKill)
	if err != nil {
		if ctx.Err() != nil {
			fmt.Fprintln(a.stdout, "\ninterrupted; cleaning up")
			return exitOK
		}
		return fail(err)
	}
	fmt.Fprintf(a.stdout, "\nSummary, on %s:\n", kind)
	fmt.Fprintf(a.stdout, "  takeover after SIGKILL of the leader:   %v  (SIGKILL sent -> next leader elected)\n", res.takeover.Round(time.Millisecond))
	fmt.Fprintf(a.stdout, "  handover after SIGTERM to the leader:   %v  (SIGTERM sent -> next leader elected; includes stopping its command)\n", res.handover.Round(time.Millisecond))
	fmt.Fprintf(a.stdout, "  the killed leader's command was gone before the next one started: %v\n", yesNo(res.killedChildGone))
	fmt.Fprintf(a.stdout, "  at most one command ran at any moment: %v\n", yesNo(res.neverTwo))
	fmt.Fprintf(a.stdout, "  whole demo: %v\n", time.Since(d.t0).Round(time.Millisecond))
	return exitOK
}

// demoConfig is the candidates' settings, for checking --ttl up front.
func demoConfig(ttl time.Duration) leader.Config {
	return leader.Config{Name: "demo", TTL: ttl, StopGrace: defaultGrace(ttl) + killMargin(ttl)}
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "NO"
}

func (d *demo) say(at time.Time, format string, args ...any) {
	fmt.Fprintf(d.out, "  %+8.3fs  %s\n", at.Sub(d.t0).Seconds(), fmt.Sprintf(format, args...))
}

func (d *demo) startCandidate(exe, store, strategy, name, id string, ttl time.Duration) (*demoCandidate, error) {
	args := []string{"run", "--store", store, "--name", name, "--id", id, "--ttl", ttl.String(), "--log-format", "json"}
	if strategy != "" {
		args = append(args, "--strategy", strategy)
	}
	cmd := exec.Command(exe, append(args, "--", exe, demoChildCommand.name)...)
	// The demo's own store choice wins over the environment.
	cmd.Env = append(os.Environ(), envStore+"=")
	cmd.SysProcAttr = demoCandidateAttr()
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting candidate %s: %w", id, err)
	}
	c := &demoCandidate{id: id, cmd: cmd, done: make(chan struct{})}
	d.cands = append(d.cands, c)
	readers := make(chan struct{}, 2)
	go func() {
		defer func() { readers <- struct{}{} }()
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			d.evs <- demoEvent{at: time.Now(), cand: id, msg: "output", text: sc.Text()}
		}
	}()
	go func() {
		defer func() { readers <- struct{}{} }()
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			var rec map[string]any
			if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
				d.evs <- demoEvent{at: time.Now(), cand: id, msg: "output", text: sc.Text()}
				continue
			}
			at := time.Now()
			if s, ok := rec["time"].(string); ok {
				if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
					at = t
				}
			}
			msg, _ := rec["msg"].(string)
			d.evs <- demoEvent{at: at, cand: id, msg: msg, attr: rec}
		}
	}()
	go func() {
		<-readers
		<-readers
		_ = cmd.Wait()
		close(c.done)
	}()
	return c, nil
}

func (d *demo) candidate(id string) *demoCandidate {
	for _, c := range d.cands {
		if c.id == id {
			return c
		}
	}
	return nil
}

type demoResult struct {
	takeover, handover        time.Duration
	killedChildGone, neverTwo bool
}

// script plays the demo: wait for a leader, kill it, wait for the next,
// stop it gracefully, wait for the next, stop everyone. afterKill, if not
// empty, is said after the kill.
func (d *demo) script(ctx context.Context, ttl time.Duration, afterKill string) (demoResult, error) {
	res := demoResult{neverTwo: true, killedChildGone: true}
	limit := 10*time.Second + 2*ttl

	first, _, err := d.until(ctx, limit, &res, "a leader", d.elected(""))
	if err != nil {
		return res, err
	}
	if _, _, err := d.until(ctx, limit, &res, "its command to start", d.started(first)); err != nil {
		return res, err
	}
	if err := d.watchFor(ctx, 1500*time.Millisecond, &res); err != nil {
		return res, err
	}

	victim := d.candidate(first)
	killedChild := d.childPid[first]
	d.say(time.Now(), "SIGKILL -> %s (pid %d), the leader: no chance to clean up", first, victim.cmd.Process.Pid)
	killedAt := time.Now()
	_ = victim.cmd.Process.Kill()
	if afterKill != "" {
		d.say(time.Now(), "(%s)", afterKill)
	}
	second, electedAt, err := d.until(ctx, limit, &res, "a new leader", d.elected(first))
	if err != nil {
		return res, err
	}
	res.takeover = electedAt.Sub(killedAt)
	d.say(electedAt, "=> takeover after SIGKILL: %v", res.takeover.Round(time.Millisecond))
	if _, _, err := d.until(ctx, limit, &res, "the new leader's command to start", d.started(second)); err != nil {
		return res, err
	}
	if killedChild > 0 {
		if pidAlive(killedChild) {
			res.killedChildGone = false
			d.say(time.Now(), "!! %s's command (pid %d) still runs", first, killedChild)
		} else {
			d.say(time.Now(), "%s's command (pid %d) is gone: it was killed along with its leader", first, killedChild)
		}
	}
	if err := d.watchFor(ctx, 1500*time.Millisecond, &res); err != nil {
		return res, err
	}

	leaving := d.candidate(second)
	d.say(time.Now(), "SIGTERM -> %s (pid %d), the leader: a graceful stop", second, leaving.cmd.Process.Pid)
	termAt := time.Now()
	_ = leaving.cmd.Process.Signal(syscall.SIGTERM)
	third, electedAt, err := d.until(ctx, limit, &res, "the handover", d.elected(second))
	if err != nil {
		return res, err
	}
	res.handover = electedAt.Sub(termAt)
	d.say(electedAt, "=> handover after SIGTERM: %v", res.handover.Round(time.Millisecond))
	if _, _, err := d.until(ctx, limit, &res, "the last leader's command to start", d.started(third)); err != nil {
		return res, err
	}
	if err := d.watchFor(ctx, time.Second, &res); err != nil {
		return res, err
	}
	d.say(time.Now(), "stopping the demo: SIGTERM -> %s", third)
	last := d.candidate(third)
	_ = last.cmd.Process.Signal(syscall.SIGTERM)
	_, _, err = d.until(ctx, limit, &res, "the last candidate to stop", func(demoEvent) (string, bool) {
		select {
		case <-last.done:
			return third, true
		default:
			return "", false
		}
	})
	// Its last words were all sent before it counted as done.
	for drained := false; !drained; {
		select {
		case ev := <-d.evs:
			d.narrate(ev, &res)
		default:
			drained = true
		}
	}
	return res, err
}

// elected matches an "elected" event by a candidate other than not.
func (d *demo) elected(not string) func(demoEvent) (string, bool) {
	return func(ev demoEvent) (string, bool) {
		return ev.cand, ev.msg == "elected" && ev.cand != not
	}
}

func (d *demo) started(id string) func(demoEvent) (string, bool) {
	return func(ev demoEvent) (string, bool) {
		return id, ev.msg == "command started" && ev.cand == id
	}
}

// until narrates events until match accepts one (returning its candidate
// and time) or limit passes. match is also tried on a timer tick, with a
// zero event, for conditions on processes.
func (d *demo) until(ctx context.Context, limit time.Duration, res *demoResult, what string, match func(demoEvent) (string, bool)) (string, time.Time, error) {
	deadline := time.NewTimer(limit)
	defer deadline.Stop()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return "", time.Time{}, ctx.Err()
		case <-deadline.C:
			return "", time.Time{}, fmt.Errorf("timed out after %v waiting for %s", limit, what)
		case ev := <-d.evs:
			d.narrate(ev, res)
			if id, ok := match(ev); ok {
				return id, ev.at, nil
			}
		case <-tick.C:
			if id, ok := match(demoEvent{}); ok {
				return id, time.Now(), nil
			}
		}
	}
}

// watchFor narrates events for a while.
func (d *demo) watchFor(ctx context.Context, dur time.Duration, res *demoResult) error {
	_, _, err := d.until(ctx, dur, res, "", func(demoEvent) (string, bool) { return "", false })
	if err != nil && ctx.Err() == nil {
		return nil // the time is up: that is the point
	}
	return err
}

// narrate prints one event on the timeline, if it is worth a line.
func (d *demo) narrate(ev demoEvent, res *demoResult) {
	num := func(k string) int64 {
		f, _ := ev.attr[k].(float64)
		return int64(f)
	}
	switch ev.msg {
	case "output":
		d.say(ev.at, "%s's command: %s", ev.cand, ev.text)
	case "elected":
		d.say(ev.at, "%s is elected leader (term %d)", ev.cand, num("term"))
	case "command started":
		pid := int(num("pid"))
		for other, p := range d.childPid {
			if other != ev.cand && pidAlive(p) {
				res.neverTwo = false
				res.killedChildGone = false
				d.say(ev.at, "!! %s's command (pid %d) still runs", other, p)
			}
		}
		d.childPid[ev.cand] = pid
		d.say(ev.at, "%s starts its command (pid %d, in its own process group)", ev.cand, pid)
	case "leadership lost: stopping the command":
		d.say(ev.at, "%s stops its command: SIGTERM to its process group (SIGKILL after %v)", ev.cand, time.Duration(num("grace")))
	case "command stopped":
		delete(d.childPid, ev.cand)
		d.say(ev.at, "%s's command has exited (%v)", ev.cand, ev.attr["result"])
	case "released":
		d.say(ev.at, "%s released the lease", ev.cand)
	case "stopped":
		d.say(ev.at, "%s has stopped", ev.cand)
	}
	if lvl, _ := ev.attr["level"].(string); lvl == "WARN" || lvl == "ERROR" {
		d.say(ev.at, "%s logs %s: %s", ev.cand, strings.ToLower(lvl), ev.msg)
	}
}

// cleanup stops every candidate still running: SIGTERM, then SIGKILL.
func (d *demo) cleanup() {
	signal.Ignore(os.Interrupt) // a second Ctrl-C must not leave processes behind
	defer signal.Reset(os.Interrupt)
	deadline := time.Now().Add(5 * time.Second)
	for _, c := range d.cands {
		_ = c.cmd.Process.Signal(syscall.SIGTERM)
	}
	for _, c := range d.cands {
		for {
			select {
			case <-c.done:
			case ev := <-d.evs:
				_ = ev // drain, so readers never block
				continue
			case <-time.After(time.Until(deadline)):
				_ = c.cmd.Process.Kill()
				<-c.done
			}
			break
		}
	}
}

// runDemoChild is the demo candidates' command.
func runDemoChild(a *app, ctx context.Context, _ []string) int {
	term := os.Getenv("LEADER_TERM")
	fmt.Fprintf(a.stdout, "working (I run only while %s leads, term %s)\n", os.Getenv("LEADER_ID"), term)
	tick := time.NewTicker(600 * time.Millisecond)
	defer tick.Stop()
	for n := 1; ; n++ {
		select {
		case <-ctx.Done():
			fmt.Fprintln(a.stdout, "got SIGTERM: finishing up and exiting")
			return 0
		case <-tick.C:
			fmt.Fprintf(a.stdout, "still working (%d)\n", n)
		}
	}
}
