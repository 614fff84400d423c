// Command gapsched tells where the time of the bench's transfers went, by
// the kernel's scheduler: which process ran, on which CPU, from the old
// leader's release to the successor's Acquire returning. It reads two
// files of one run, made by scripts/gap-sched (run by hand, never in CI):
//
//   - the candidates' trace (LEADERBENCH_TRACE=1 and -child-log FILE;
//     see bench/tracelog.go), stamped with CLOCK_MONOTONIC;
//   - the text of perf's scheduler events of the same time, recorded on
//     CLOCK_MONOTONIC (perf record -e sched:sched_switch -e
//     sched:sched_waking -a -k CLOCK_MONOTONIC, then perf script -F
//     comm,pid,tid,cpu,time,event,trace --ns).
//
// A transfer runs from the old leader's "release-to ID start" to the
// "acquire end ok=true" of the process that then logs "elected ID". The
// wakes are the sched_waking events, which the kernel records in the
// waker's context. Older recordings with sched_wakeup only are read too,
// but less reliably: a sched_wakeup of a task on another CPU is often
// recorded in that CPU's context, under its running task's name, so the
// waker is unknown and the transfer is dropped (no backend pair).
// sched_switch is read in perf's field=value form (prev_comm=... ==>
// next_comm=...); the form of libtraceevent's sched_switch plugin
// ("perf:25020 [120] D ==> ...") is not, and gapsched says so.
//
// For each transfer it finds the old leader's backend as the first
// PostgreSQL backend that, after the release starts, wakes another
// backend which then wakes a thread of the successor's process: the woken
// backend is the successor's (it waited for the handover's lock, and
// sends Acquire's reply). It splits the transfer at the old backend's
// first switch-in after the release starts (the start if it was running
// then), the wake, the successor's backend's first switch-in after the
// wake and its last switch-out before Acquire returns, and prints each
// segment's p50, p90 and max (nearest rank, as the bench's report):
//
//	release → old backend runs   the old leader's process, until its statement reaches the server
//	old backend → wake           the old leader's backend, until it frees the lock
//	wake → successor runs        the successor's backend, woken, until a CPU runs it
//	successor backend            the successor's statements
//	→ Acquire returns            the successor's process reading the reply
//
// It counts the transfers it drops, by reason: no successor's Acquire in
// the trace (no "acquire end ok=true" by the process that logs "elected
// ID" before the next release); outside the events' time; no backend
// pair; the old backend's switches not recorded (two switch-ins or two
// switch-outs in a row, or no switch-in before it wakes the successor's);
// the successor's backend never switched in, or never switched out,
// before Acquire returns; or its switches not recorded.
//
// Then, for the slowest transfers, it lists the top 8 tasks by CPU time,
// and how many of the CPUs' intervals followed a switch that was not
// recorded (each is credited to the task that its closing switch switched
// out, as the kernel names it).
//
// Usage:
//
//	go -C bench run ./gapsched -trace TRACE.log -perf PERF.txt [-slowest 3]
package main

import (
	"bufio"
	"cmp"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"
)

func main() {
	tracePath := flag.String("trace", "", "the candidates' trace (the bench's -child-log with LEADERBENCH_TRACE=1)")
	perfPath := flag.String("perf", "", "perf script's text of sched_switch and sched_waking (or sched_wakeup), recorded on CLOCK_MONOTONIC")
	slowest := flag.Int("slowest", 3, "list the tasks' CPU time during this many of the slowest transfers")
	flag.Parse()
	if *tracePath == "" || *perfPath == "" {
		flag.Usage()
		os.Exit(2)
	}
	if err := run(os.Stdout, *tracePath, *perfPath, *slowest); err != nil {
		fmt.Fprintln(os.Stderr, "gapsched:", err)
		os.Exit(1)
	}
}

// run reads the trace and the events, splits the transfers and writes the
// report to w.
func run(w io.Writer, tracePath, perfPath string, slowest int) error {
	tf, err := os.Open(tracePath)
	if err != nil {
		return err
	}
	defer tf.Close()
	transfers, unmatched, err := readTransfers(tf)
	if err != nil {
		return fmt.Errorf("%s: %w", tracePath, err)
	}
	pf, err := os.Open(perfPath)
	if err != nil {
		return err
	}
	defer pf.Close()
	events, wakeEvent, err := readEvents(pf)
	if err != nil {
		return fmt.Errorf("%s: %w", perfPath, err)
	}
	segs, dropped := analyze(transfers, events)
	dropped[dropNoAcquire] += unmatched
	report(w, segs, dropped, events, wakeEvent, slowest)
	return nil
}

// transfer is one handover of the trace: the old leader's release starts
// at start, and the successor's Acquire returns at end, in process to.
// Times are CLOCK_MONOTONIC nanoseconds.
type transfer struct {
	start, end int64
	to         int
}

// readTransfers reads the trace's lines ("TRACE <ns> <pid> <what...>"),
// in any order, and returns a transfer for each "release-to ID start"
// whose successor (the process that logs "elected ID" next, before any
// other release starts) logged "acquire end ok=true" since; unmatched
// counts the releases without one.
func readTransfers(r io.Reader) (trs []transfer, unmatched int, err error) {
	type line struct {
		t    int64
		pid  int
		what string
	}
	var lines []line
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 4 || f[0] != "TRACE" {
			continue
		}
		t, err1 := strconv.ParseInt(f[1], 10, 64)
		pid, err2 := strconv.Atoi(f[2])
		if err := errors.Join(err1, err2); err != nil {
			return nil, 0, fmt.Errorf("a trace line without its time or pid: %q: %w", sc.Text(), err)
		}
		lines = append(lines, line{t, pid, strings.Join(f[3:], " ")})
	}
	if err := sc.Err(); err != nil {
		return nil, 0, err
	}
	slices.SortStableFunc(lines, func(a, b line) int { return cmp.Compare(a.t, b.t) })
	// releaseOf returns the successor's ID if l starts a release.
	releaseOf := func(l line) (successor string, ok bool) {
		f := strings.Fields(l.what)
		if len(f) == 3 && f[0] == "release-to" && f[2] == "start" {
			return f[1], true
		}
		return "", false
	}
	for i, l := range lines {
		successor, ok := releaseOf(l)
		if !ok {
			continue
		}
		var tr transfer
		for k, m := range lines[i+1:] {
			if _, ok := releaseOf(m); ok {
				break // the next release: this one had no successor's Acquire
			}
			if m.what != "elected "+successor {
				continue
			}
			// The successor's first Acquire that succeeded since the release.
			for _, a := range lines[i+1 : i+1+k] {
				if a.pid == m.pid && strings.HasPrefix(a.what, "acquire end ok=true") {
					tr = transfer{start: l.t, end: a.t, to: m.pid}
					break
				}
			}
			break
		}
		if tr.to == 0 {
			unmatched++
			continue
		}
		trs = append(trs, tr)
	}
	return trs, unmatched, nil
}

// task is a thread as the scheduler's events name it: comm is its name
// then, tid its thread ID (0 for each CPU's idle task).
type task struct {
	comm string
	tid  int
}

// String returns "comm:tid".
func (t task) String() string { return t.comm + ":" + strconv.Itoa(t.tid) }

// event is a scheduler event: a switch on cpu from prev to next, or, if
// wake, a wake-up of next recorded on cpu while prev ran there (the waker,
// for sched_waking). nextPID is next's process (0 if no event was
// recorded in its context).
type event struct {
	t          int64
	cpu        int
	wake       bool
	prev, next task
	nextPID    int
}

// The lines of perf script -F comm,pid,tid,cpu,time,event,trace --ns:
// perfHead is the part every event has, switchBody and wakeBody the
// fields of sched_switch and of sched_waking or sched_wakeup.
var (
	perfHead   = regexp.MustCompile(`^\s*(.+?)\s+(\d+)/(\d+)\s+\[(\d+)\]\s+(\d+)\.(\d{9}):\s+sched:(sched_switch|sched_waking|sched_wakeup):\s+(.*)$`)
	switchBody = regexp.MustCompile(`^prev_comm=(.*?) prev_pid=(\d+) .*==> next_comm=(.*?) next_pid=(\d+)`)
	wakeBody   = regexp.MustCompile(`^comm=(.*?) pid=(\d+) `)
)

// readEvents reads perf script's lines of sched_switch, sched_waking and
// sched_wakeup, and returns them in time order. If the file has
// sched_waking events, its sched_wakeup events are left out; wakeEvent
// names the kind of the wake events returned. Lines of other events are
// skipped; a file with none of these is an error.
func readEvents(r io.Reader) (ev []event, wakeEvent string, err error) {
	pidOf := map[int]int{} // a thread's process, from the events in its context
	var wakings, wakeups []event
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		m := perfHead.FindStringSubmatch(sc.Text())
		if m == nil {
			continue
		}
		sec, _ := strconv.ParseInt(m[5], 10, 64)
		ns, _ := strconv.ParseInt(m[6], 10, 64)
		cpu, _ := strconv.Atoi(m[4])
		pid, _ := strconv.Atoi(m[2])
		tid, _ := strconv.Atoi(m[3])
		pidOf[tid] = pid
		e := event{t: sec*1e9 + ns, cpu: cpu}
		switch m[7] {
		case "sched_switch":
			b := switchBody.FindStringSubmatch(m[8])
			if b == nil {
				return nil, "", fmt.Errorf("a sched_switch without its prev_comm=... ==> next_comm=... fields (perf's libtraceevent sched_switch plugin form is not read): %q", sc.Text())
			}
			prevTID, _ := strconv.Atoi(b[2])
			nextTID, _ := strconv.Atoi(b[4])
			e.prev, e.next = task{b[1], prevTID}, task{b[3], nextTID}
			ev = append(ev, e)
		default:
			b := wakeBody.FindStringSubmatch(m[8])
			if b == nil {
				return nil, "", fmt.Errorf("a %s without its comm=... pid=... fields: %q", m[7], sc.Text())
			}
			nextTID, _ := strconv.Atoi(b[2])
			e.wake, e.prev, e.next = true, task{m[1], tid}, task{b[1], nextTID}
			if m[7] == "sched_waking" {
				wakings = append(wakings, e)
			} else {
				wakeups = append(wakeups, e)
			}
		}
	}
	if err := sc.Err(); err != nil {
		return nil, "", err
	}
	switch {
	case len(wakings) > 0:
		ev, wakeEvent = append(ev, wakings...), "sched_waking"
	case len(wakeups) > 0:
		ev, wakeEvent = append(ev, wakeups...), "sched_wakeup"
	case len(ev) == 0:
		return nil, "", errors.New("no line of perf script's sched_switch, sched_waking or sched_wakeup events (\"comm pid/tid [cpu] sec.nanoseconds: sched:...\"; made without --ns?)")
	}
	for i := range ev {
		ev[i].nextPID = pidOf[ev[i].next.tid]
	}
	slices.SortStableFunc(ev, func(a, b event) int { return cmp.Compare(a.t, b.t) })
	return ev, wakeEvent, nil
}

// segments are one transfer's parts, in order; they add up to its whole.
type segments struct {
	tr                                             transfer
	toOld, oldRun, toNew, newRun, toAcquire, total time.Duration
	old, succ                                      task // the two backends
}

// segmentNames are the names of the durations that values returns, in
// its order.
var segmentNames = []string{"release → old backend runs", "old backend → wake", "wake → successor runs", "successor backend", "→ Acquire returns", "whole"}

// values returns the segments' durations and the whole, in segmentNames'
// order.
func (s segments) values() []time.Duration {
	return []time.Duration{s.toOld, s.oldRun, s.toNew, s.newRun, s.toAcquire, s.total}
}

// The reasons a transfer is dropped, in the report's order.
const (
	dropNoAcquire = "no successor's Acquire in the trace"
	dropOutside   = "outside the events"
	dropNoPair    = "no backend pair"
	dropOldChain  = "old backend's switches not recorded"
	dropNoIn      = "successor's backend never switched in"
	dropNoOut     = "successor's backend never switched out"
	dropNewChain  = "successor's backend's switches not recorded"
)

// dropReasons lists the reasons to drop a transfer, in the report's order.
var dropReasons = []string{dropNoAcquire, dropOutside, dropNoPair, dropOldChain, dropNoIn, dropNoOut, dropNewChain}

// analyze splits each transfer into its segments (see the package's doc),
// and counts the transfers it drops by reason.
func analyze(trs []transfer, ev []event) (segs []segments, dropped map[string]int) {
	dropped = map[string]int{}
	for _, tr := range trs {
		s, reason := split(tr, ev)
		if reason != "" {
			dropped[reason]++
			continue
		}
		segs = append(segs, s)
	}
	return segs, dropped
}

// split splits one transfer into its segments, or returns why it cannot.
func split(tr transfer, ev []event) (s segments, dropReason string) {
	if len(ev) == 0 || tr.start < ev[0].t || tr.end > ev[len(ev)-1].t {
		return s, dropOutside
	}
	s.tr = tr
	// The old leader's backend wakes the successor's (the lock), which
	// wakes the successor's process (its reply): the first such pair of
	// backends names both.
	var wokeAt int64
	found := false
	for j := sort.Search(len(ev), func(j int) bool { return ev[j].t >= tr.start }); j < len(ev) && ev[j].t <= tr.end; j++ {
		e := ev[j]
		if e.wake && isBackend(e.prev) && isBackend(e.next) && e.prev.tid != e.next.tid && wakes(ev[j+1:], tr.end, e.next, tr.to) {
			s.old, s.succ, wokeAt, found = e.prev, e.next, e.t, true
			break
		}
	}
	if !found {
		return s, dropNoPair
	}
	running, ins, _, broken := switchesOf(ev, s.old, tr.start, wokeAt)
	if broken || !running && len(ins) == 0 { // it ran, to wake the successor's
		return s, dropOldChain
	}
	oldAt := tr.start
	if !running {
		oldAt = ins[0]
	}
	_, ins, outs, broken := switchesOf(ev, s.succ, wokeAt, tr.end)
	switch {
	case broken:
		return s, dropNewChain
	case len(ins) == 0:
		return s, dropNoIn
	case len(outs) == 0 || outs[len(outs)-1] < ins[0]:
		return s, dropNoOut
	}
	newIn, newOut := ins[0], outs[len(outs)-1]
	s.toOld = time.Duration(oldAt - tr.start)
	s.oldRun = time.Duration(wokeAt - oldAt)
	s.toNew = time.Duration(newIn - wokeAt)
	s.newRun = time.Duration(newOut - newIn)
	s.toAcquire = time.Duration(tr.end - newOut)
	s.total = time.Duration(tr.end - tr.start)
	return s, ""
}

// switchesOf returns when t was switched in and out between from and to,
// in time order, and whether it was running at from (its last switch
// before from switched it in). broken reports two switch-ins or two
// switch-outs of t in a row from then on: a switch of t was not recorded.
func switchesOf(ev []event, t task, from, to int64) (running bool, ins, outs []int64, broken bool) {
	i := sort.Search(len(ev), func(i int) bool { return ev[i].t >= from })
	for _, e := range slices.Backward(ev[:i]) {
		if !e.wake && e.prev.tid != e.next.tid && (e.prev.tid == t.tid || e.next.tid == t.tid) {
			running = e.next.tid == t.tid
			break
		}
	}
	on := running
	for _, e := range ev[i:] {
		if e.t > to {
			break
		}
		if e.wake || e.prev.tid == e.next.tid {
			continue
		}
		switch t.tid {
		case e.next.tid:
			broken = broken || on
			on, ins = true, append(ins, e.t)
		case e.prev.tid:
			broken = broken || !on
			on, outs = false, append(outs, e.t)
		}
	}
	return running, ins, outs, broken
}

// wakes reports whether t wakes a thread of process pid in ev, by until.
func wakes(ev []event, until int64, t task, pid int) bool {
	for _, e := range ev {
		if e.t > until {
			return false
		}
		if e.wake && e.prev.tid == t.tid && e.nextPID == pid {
			return true
		}
	}
	return false
}

// isBackend reports whether t is a PostgreSQL backend.
func isBackend(t task) bool { return t.comm == "postgres" }

// cpuTime returns each task's time on a CPU between from and to, the idle
// tasks' (swapper/N) included, by the CPUs' switches: each interval
// between two switches of a CPU goes to the task that the second switches
// out (the first interval, from from, too, if the CPU has no switch
// before). It adds up to to-from times the CPUs with a switch recorded.
// broken counts the intervals whose task is not the one the first switch
// switched in: a switch between them was not recorded.
func cpuTime(ev []event, from, to int64) (byTask map[string]time.Duration, broken int) {
	byTask = map[string]time.Duration{}
	running := map[int]task{} // the task each CPU's last switch switched in
	since := map[int]int64{}  // when each CPU's current interval started
	i := sort.Search(len(ev), func(i int) bool { return ev[i].t >= from })
	for _, e := range slices.Backward(ev[:i]) {
		if _, ok := running[e.cpu]; !e.wake && !ok {
			running[e.cpu], since[e.cpu] = e.next, from
		}
	}
	for _, e := range ev[i:] {
		if e.wake {
			continue
		}
		start, seen := since[e.cpu]
		if e.t > to {
			if !seen { // no switch in the whole time: its task ran throughout
				byTask[e.prev.String()] += time.Duration(to - from)
				since[e.cpu] = to
			}
			continue
		}
		if !seen {
			start = from
		}
		if r, ok := running[e.cpu]; ok && r.tid != e.prev.tid {
			broken++
		}
		byTask[e.prev.String()] += time.Duration(e.t - start)
		running[e.cpu], since[e.cpu] = e.next, e.t
	}
	for cpu, t := range running {
		byTask[t.String()] += time.Duration(to - since[cpu])
	}
	return byTask, broken
}

// percentile returns the p-th quantile of sorted, by nearest rank, as the
// bench's report does (bench/report.go).
func percentile(sorted []time.Duration, p float64) time.Duration {
	i := int(math.Ceil(p*float64(len(sorted)))) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

// report writes the segments' p50, p90 and max, the dropped transfers by
// reason, and the top tasks by CPU time during the slowest transfers.
func report(w io.Writer, segs []segments, dropped map[string]int, ev []event, wakeEvent string, slowest int) {
	if wakeEvent == "sched_wakeup" {
		fmt.Fprintln(w, "wakes: sched_wakeup, often recorded on the woken task's CPU under its running task rather than the waker, which drops transfers for no backend pair; record sched_waking (scripts/gap-sched does)")
	}
	total, n := len(segs), 0
	var reasons []string
	for _, r := range dropReasons {
		if dropped[r] > 0 {
			n += dropped[r]
			reasons = append(reasons, fmt.Sprintf("%d %s", dropped[r], r))
		}
	}
	total += n
	if len(segs) == 0 {
		fmt.Fprintf(w, "no transfer to split: %d of %d dropped (%s)\n", n, total, strings.Join(reasons, ", "))
		if dropped[dropOutside] == n && n > 0 {
			fmt.Fprintln(w, "all outside the events' time: were both recorded on CLOCK_MONOTONIC, at the same time?")
		}
		return
	}
	dropNote := ""
	if n > 0 {
		dropNote = fmt.Sprintf(" (%d dropped: %s)", n, strings.Join(reasons, ", "))
	}
	fmt.Fprintf(w, "%d of %d transfers%s, in µs\n\n| Segment | p50 | p90 | max |\n|---|---|---|---|\n", len(segs), total, dropNote)
	for k, name := range segmentNames {
		v := make([]time.Duration, len(segs))
		for i, s := range segs {
			v[i] = s.values()[k]
		}
		slices.Sort(v)
		fmt.Fprintf(w, "| %s | %d | %d | %d |\n", name, percentile(v, 0.5).Microseconds(), percentile(v, 0.9).Microseconds(), v[len(v)-1].Microseconds())
	}
	slices.SortFunc(segs, func(a, b segments) int { return cmp.Compare(b.total, a.total) })
	for _, s := range segs[:min(slowest, len(segs))] {
		byTask, broken := cpuTime(ev, s.tr.start, s.tr.end)
		fmt.Fprintf(w, "\nA slow transfer: %d µs, old backend %s, successor's %s; the top tasks by CPU time (µs):\n", s.total.Microseconds(), s.old, s.succ)
		tasks := make([]string, 0, len(byTask))
		for t := range byTask {
			tasks = append(tasks, t)
		}
		slices.SortFunc(tasks, func(a, b string) int { return cmp.Or(cmp.Compare(byTask[b], byTask[a]), cmp.Compare(a, b)) })
		for _, t := range tasks[:min(8, len(tasks))] {
			fmt.Fprintf(w, "  %-28s %6d\n", t, byTask[t].Microseconds())
		}
		if broken > 0 {
			fmt.Fprintf(w, "  intervals after a missing switch: %d (each credited to the task switched out at its end)\n", broken)
		}
	}
}
