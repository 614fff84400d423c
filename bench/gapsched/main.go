// Command gapsched tells where the time of the bench's transfers went, by
// the kernel's scheduler: which process ran, on which CPU, from the old
// leader's release to the successor's Acquire returning. It reads two
// files of one run, made by scripts/gap-sched (run by hand, never in CI):
//
//   - the candidates' trace (LEADERBENCH_TRACE=1 and -child-log FILE;
//     see bench/tracelog.go), stamped with CLOCK_MONOTONIC;
//   - the text of perf's scheduler events of the same time, recorded on
//     CLOCK_MONOTONIC (perf record -e sched:sched_switch -e
//     sched:sched_wakeup -a -k CLOCK_MONOTONIC, then perf script -F
//     comm,pid,tid,cpu,time,event,trace --ns).
//
// For each transfer it finds the first server backend that runs after the
// release starts (the old leader's), the backend that it wakes (the
// successor's, waiting for the handover's lock), and when the successor's
// backend stops running before Acquire returns, and prints each
// segment's p50, p90 and max:
//
//	release → old backend runs   the old leader's process, until its statement reaches the server
//	old backend → wake           the old leader's backend, until it frees the lock
//	wake → successor runs        the successor's backend, woken, until a CPU runs it
//	successor backend            the successor's statements
//	→ Acquire returns            the successor's process reading the reply
//
// It then lists the CPU time of every task during the slowest transfers.
//
// Usage:
//
//	go -C bench run ./gapsched -trace TRACE.log -perf PERF.txt [-slowest 3]
package main

import (
	"bufio"
	"errors"
	"flag"
	"fmt"
	"io"
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
	perfPath := flag.String("perf", "", "perf script's text of sched_switch and sched_wakeup, recorded on CLOCK_MONOTONIC")
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

func run(w io.Writer, tracePath, perfPath string, slowest int) error {
	tf, err := os.Open(tracePath)
	if err != nil {
		return err
	}
	defer tf.Close()
	transfers, err := readTransfers(tf)
	if err != nil {
		return fmt.Errorf("%s: %w", tracePath, err)
	}
	pf, err := os.Open(perfPath)
	if err != nil {
		return err
	}
	defer pf.Close()
	events, err := readEvents(pf)
	if err != nil {
		return fmt.Errorf("%s: %w", perfPath, err)
	}
	report(w, analyze(transfers, events), events, slowest)
	return nil
}

// transfer is one handover of the trace: the old leader's release starts
// at start (in process from), and the successor's Acquire returns at end
// (in process to). Times are CLOCK_MONOTONIC nanoseconds.
type transfer struct {
	start, end int64
	from, to   int
}

// readTransfers reads the trace's lines ("TRACE <ns> <pid> <what...>"),
// in any order, and returns each release-to start followed by another
// process's acquire end, the first after it.
func readTransfers(r io.Reader) ([]transfer, error) {
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
			return nil, fmt.Errorf("%q: %w", sc.Text(), err)
		}
		lines = append(lines, line{t, pid, strings.Join(f[3:], " ")})
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	slices.SortStableFunc(lines, func(a, b line) int { return cmpInt(a.t, b.t) })
	var out []transfer
	for i, l := range lines {
		if !strings.HasPrefix(l.what, "release-to ") || !strings.HasSuffix(l.what, " start") {
			continue
		}
		for _, m := range lines[i+1:] {
			if m.pid != l.pid && strings.HasPrefix(m.what, "acquire end") {
				out = append(out, transfer{start: l.t, end: m.t, from: l.pid, to: m.pid})
				break
			}
			if m.pid == l.pid && strings.HasPrefix(m.what, "release-to ") && strings.HasSuffix(m.what, " start") {
				break // the next release: this one had no successor's Acquire
			}
		}
	}
	return out, nil
}

// event is a scheduler event: a switch on cpu from prev to next (state is
// prev's), or a wake-up of next by prev (the running task, of process
// byPID), onto cpu. Tasks are "comm:tid"; nextPID is next's process
// (0 if no event ran on it).
type event struct {
	t          int64
	cpu        int
	wake       bool
	prev, next string
	state      string
	byPID      int
	nextPID    int
}

var (
	perfHead   = regexp.MustCompile(`^\s*(.+?)\s+(\d+)/(\d+)\s+\[(\d+)\]\s+(\d+)\.(\d{9}):\s+sched:(sched_switch|sched_wakeup):\s+(.*)$`)
	switchBody = regexp.MustCompile(`prev_comm=(.*?) prev_pid=(\d+) .*prev_state=(\S+) ==> next_comm=(.*?) next_pid=(\d+)`)
	wakeBody   = regexp.MustCompile(`comm=(.*?) pid=(\d+) .*target_cpu=(\d+)`)
)

// readEvents reads perf script's lines of sched_switch and sched_wakeup,
// in time order; other lines are skipped.
func readEvents(r io.Reader) ([]event, error) {
	var out []event
	pidOf := map[string]int{} // a thread's process, from the events that ran on it
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
		pidOf[m[1]+":"+m[3]] = pid
		e := event{t: sec*1e9 + ns, cpu: cpu}
		switch m[7] {
		case "sched_switch":
			b := switchBody.FindStringSubmatch(m[8])
			if b == nil {
				return nil, fmt.Errorf("a sched_switch without its fields: %q", sc.Text())
			}
			e.prev, e.state, e.next = b[1]+":"+b[2], b[3], b[4]+":"+b[5]
		default:
			b := wakeBody.FindStringSubmatch(m[8])
			if b == nil {
				return nil, fmt.Errorf("a sched_wakeup without its fields: %q", sc.Text())
			}
			e.wake, e.prev, e.next = true, m[1]+":"+m[3], b[1]+":"+b[2]
			e.cpu, _ = strconv.Atoi(b[3])
			e.byPID, _ = strconv.Atoi(m[2])
		}
		out = append(out, e)
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	for i := range out {
		out[i].nextPID = pidOf[out[i].next]
	}
	slices.SortStableFunc(out, func(a, b event) int { return cmpInt(a.t, b.t) })
	return out, nil
}

// segments are one transfer's parts, in order; they add up to its whole.
type segments struct {
	tr                                             transfer
	toOld, oldRun, toNew, newRun, toAcquire, total time.Duration
	old, succ                                      string // the two backends
}

var segmentNames = []string{"release → old backend runs", "old backend → wake", "wake → successor runs", "successor backend", "→ Acquire returns", "whole"}

func (s segments) values() []time.Duration {
	return []time.Duration{s.toOld, s.oldRun, s.toNew, s.newRun, s.toAcquire, s.total}
}

// analyze splits each transfer that the events cover into its segments
// (see the package's doc). A transfer whose backends it cannot tell (no
// backend ran, or none woke another) is left out.
func analyze(trs []transfer, ev []event) []segments {
	var out []segments
	if len(ev) == 0 {
		return nil
	}
	for _, tr := range trs {
		if tr.start < ev[0].t || tr.end > ev[len(ev)-1].t {
			continue
		}
		i := sort.Search(len(ev), func(i int) bool { return ev[i].t >= tr.start })
		var s segments
		s.tr = tr
		// The old leader's backend wakes the successor's (the lock),
		// which wakes the successor's process (its reply): the first such
		// pair of backends names both. The old backend's segment starts
		// when it is first switched in after the release starts (at the
		// start if it was running then).
		j := i
		var wokeAt int64
		for ; j < len(ev) && ev[j].t <= tr.end; j++ {
			e := ev[j]
			if e.wake && isBackend(e.prev) && isBackend(e.next) && e.prev != e.next && wakes(ev[j+1:], tr.end, e.next, tr.to) {
				s.old, s.succ, wokeAt = e.prev, e.next, e.t
				break
			}
		}
		if s.succ == "" {
			continue
		}
		oldAt := tr.start
		for _, e := range ev[i:j] {
			if !e.wake && e.next == s.old {
				oldAt = e.t
				break
			}
		}
		var newIn, newOut int64
		for _, e := range ev[j+1:] {
			if e.t > tr.end {
				break
			}
			switch {
			case e.wake:
			case e.next == s.succ && newIn == 0:
				newIn = e.t
			case e.prev == s.succ && newIn != 0:
				newOut = e.t
			}
		}
		if s.succ == "" || newIn == 0 || newOut == 0 {
			continue
		}
		s.toOld = time.Duration(oldAt - tr.start)
		s.oldRun = time.Duration(wokeAt - oldAt)
		s.toNew = time.Duration(newIn - wokeAt)
		s.newRun = time.Duration(newOut - newIn)
		s.toAcquire = time.Duration(tr.end - newOut)
		s.total = time.Duration(tr.end - tr.start)
		out = append(out, s)
	}
	return out
}

// wakes reports whether task wakes a thread of process pid in ev, by
// until.
func wakes(ev []event, until int64, task string, pid int) bool {
	for _, e := range ev {
		if e.t > until {
			return false
		}
		if e.wake && e.prev == task && e.nextPID == pid {
			return true
		}
	}
	return false
}

// isBackend reports whether task is a PostgreSQL backend.
func isBackend(task string) bool { return strings.HasPrefix(task, "postgres:") }

// cpuTime returns each task's time on a CPU between from and to,
// the idle task's (swapper/N) included.
func cpuTime(ev []event, from, to int64) map[string]time.Duration {
	out := map[string]time.Duration{}
	running := map[int]string{}
	last := map[int]int64{}
	// What each CPU ran at from: the next task of its last switch before.
	i := sort.Search(len(ev), func(i int) bool { return ev[i].t >= from })
	for j := i - 1; j >= 0; j-- {
		e := ev[j]
		if e.wake {
			continue
		}
		if _, ok := running[e.cpu]; !ok {
			running[e.cpu], last[e.cpu] = e.next, from
		}
	}
	for _, e := range ev[i:] {
		if e.t > to {
			break
		}
		if e.wake {
			continue
		}
		if task, ok := running[e.cpu]; ok {
			out[task] += time.Duration(e.t - last[e.cpu])
		}
		running[e.cpu], last[e.cpu] = e.next, e.t
	}
	for cpu, task := range running {
		out[task] += time.Duration(to - last[cpu])
	}
	return out
}

func report(w io.Writer, segs []segments, ev []event, slowest int) {
	if len(segs) == 0 {
		fmt.Fprintln(w, "no transfer in the events' time (were both recorded on CLOCK_MONOTONIC, at the same time?)")
		return
	}
	fmt.Fprintf(w, "%d transfers (µs)\n\n| Segment | p50 | p90 | max |\n|---|---|---|---|\n", len(segs))
	for k, name := range segmentNames {
		v := make([]time.Duration, len(segs))
		for i, s := range segs {
			v[i] = s.values()[k]
		}
		slices.Sort(v)
		fmt.Fprintf(w, "| %s | %d | %d | %d |\n", name, v[len(v)/2].Microseconds(), v[len(v)*9/10].Microseconds(), v[len(v)-1].Microseconds())
	}
	slices.SortFunc(segs, func(a, b segments) int { return cmpInt(int64(b.total), int64(a.total)) })
	for _, s := range segs[:min(slowest, len(segs))] {
		fmt.Fprintf(w, "\nA slow transfer: %d µs, old backend %s, successor's %s; CPU time of each task (µs):\n", s.total.Microseconds(), s.old, s.succ)
		byTask := cpuTime(ev, s.tr.start, s.tr.end)
		tasks := make([]string, 0, len(byTask))
		for t := range byTask {
			tasks = append(tasks, t)
		}
		slices.SortFunc(tasks, func(a, b string) int { return cmpInt(int64(byTask[b]), int64(byTask[a])) })
		for _, t := range tasks[:min(8, len(tasks))] {
			fmt.Fprintf(w, "  %-28s %6d\n", t, byTask[t].Microseconds())
		}
	}
}

func cmpInt(a, b int64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}
