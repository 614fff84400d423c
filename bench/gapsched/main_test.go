package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// The fixture (testdata) has two CPUs and three releases. The first is
// split: the old leader's process (100, thread 101) sends its release at
// 1.000010 s; its backend (300) runs on CPU 0 from 1.000100, wakes
// another backend (310, which never wakes the successor) at 1.000200 and
// the successor's backend (301) at 1.000500, which runs on CPU 1 from
// 1.000600, is preempted from 1.000900 to 1.000950 and is switched out
// at 1.001300, after waking the successor's process (200, thread 201),
// whose Acquire returns at 1.001500. A follower (400) logs an Acquire
// that failed meanwhile; CPU 0's switch from idle to its thread (401) was
// not recorded, as in real runs. The waking of 301 is in 300's context;
// its sched_wakeup is in CPU 1's, under swapper. The second release is
// outside the events' time, the third has no successor's Acquire.

// TestSegments checks the fixture's report: the first transfer's split,
// the two others' drops and the top tasks' CPU time.
func TestSegments(t *testing.T) {
	out := report1(t, "testdata/trace.log", "testdata/perf.txt")
	wantIn(t, "", out,
		"1 of 3 transfers (2 dropped: 1 no successor's Acquire in the trace, 1 outside the events), in µs",
		"| release → old backend runs | 90 | 90 | 90 |",
		"| old backend → wake | 400 | 400 | 400 |",
		"| wake → successor runs | 100 | 100 | 100 |",
		"| successor backend | 700 | 700 | 700 |",
		"| → Acquire returns | 200 | 200 | 200 |",
		"| whole | 1490 | 1490 | 1490 |",
		"old backend postgres:300, successor's postgres:301",
		fmt.Sprintf("  %-28s %6d\n", "postgres:301", 650),
		"intervals after a missing switch: 1 (",
	)
	if strings.Contains(out, "sched_wakeup") {
		t.Errorf("the report warns of sched_wakeup when the wakes are sched_waking:\n%s", out)
	}
}

// TestWakeupInTheTargetCPUsContext checks the fixture without its
// sched_waking events: the wake of the successor's backend is then
// recorded under CPU 1's idle task, so no backend pair is found, and the
// report says so.
func TestWakeupInTheTargetCPUsContext(t *testing.T) {
	dir := t.TempDir()
	perf := filepath.Join(dir, "perf.txt")
	writeFile(t, perf, withoutLines(t, mustRead(t, "testdata/perf.txt"), "sched_waking:", 4))
	out := report1(t, "testdata/trace.log", perf)
	wantIn(t, "", out,
		"wakes: sched_wakeup",
		"no transfer to split: 3 of 3 dropped (1 no successor's Acquire in the trace, 1 outside the events, 1 no backend pair)",
	)
	if strings.Contains(out, "CLOCK_MONOTONIC") {
		t.Errorf("the report blames the clock for drops not all outside the events:\n%s", out)
	}
}

// TestMissingSwitch checks that a transfer is dropped, with its reason,
// when a backend's switch was not recorded, rather than split at a later
// switch: the successor's backend's switch-in, or its preemption's
// switch-out, or the old backend's switch-in.
func TestMissingSwitch(t *testing.T) {
	for _, c := range []struct {
		line, reason string
	}{
		{"prev_comm=swapper/1 prev_pid=0 prev_prio=120 prev_state=R ==> next_comm=postgres next_pid=301", dropNewChain},
		{"prev_comm=postgres prev_pid=301 prev_prio=120 prev_state=R", dropNewChain},
		{"next_comm=postgres next_pid=300", dropOldChain},
	} {
		ev := eventsOf(t, withoutLines(t, mustRead(t, "testdata/perf.txt"), c.line, 1))
		trs, _, err := readTransfers(strings.NewReader(mustRead(t, "testdata/trace.log")))
		if err != nil {
			t.Fatal(err)
		}
		segs, dropped := analyze(trs[:1], ev)
		if len(segs) != 0 || dropped[c.reason] != 1 {
			t.Errorf("without the switch %q: segments %+v, dropped %v; want dropped for %q", c.line, segs, dropped, c.reason)
		}
	}
}

// TestSeveralTransfers checks the percentiles (nearest rank) over ten
// transfers of different lengths, in a shuffled order, read from
// sched_waking and from sched_wakeup events (recorded in the waker's
// context here).
func TestSeveralTransfers(t *testing.T) {
	for _, wake := range []string{"sched_waking", "sched_wakeup"} {
		dir := t.TempDir()
		trace, perf := handovers(10, wake)
		writeFile(t, filepath.Join(dir, "trace.log"), trace)
		writeFile(t, filepath.Join(dir, "perf.txt"), perf)
		out := report1(t, filepath.Join(dir, "trace.log"), filepath.Join(dir, "perf.txt"))
		wantIn(t, wake+": ", out,
			"10 of 10 transfers, in µs",
			"| release → old backend runs | 50 | 90 | 100 |",
			"| old backend → wake | 100 | 180 | 200 |",
			"| wake → successor runs | 150 | 270 | 300 |",
			"| successor backend | 200 | 360 | 400 |",
			"| → Acquire returns | 250 | 450 | 500 |",
			"| whole | 750 | 1350 | 1500 |",
			"A slow transfer: 1500 µs",
		)
	}
}

// TestMissingSwitchOut checks the generated transfers without the third's
// switch-out of the successor's backend (301, at 3.000200 s): the third
// is dropped, and so is the fourth, where 301 is the old backend, which
// seems to run when the release starts, but is switched in again.
func TestMissingSwitchOut(t *testing.T) {
	dir := t.TempDir()
	trace, perf := handovers(10, "sched_waking")
	writeFile(t, filepath.Join(dir, "trace.log"), trace)
	writeFile(t, filepath.Join(dir, "perf.txt"), withoutLines(t, perf, "3.000200000: sched:sched_switch: prev_comm=postgres prev_pid=301", 1))
	out := report1(t, filepath.Join(dir, "trace.log"), filepath.Join(dir, "perf.txt"))
	wantIn(t, "", out, "8 of 10 transfers (2 dropped: 1 old backend's switches not recorded, 1 successor's backend never switched out), in µs")
}

// TestCPUTime checks the CPU time of each task: during the fixture's
// transfer (CPU 0 runs the old leader's thread, its backend, the other
// backend, the follower's thread, whose switch-in was not recorded and
// is credited the idle time before, then idle; CPU 1 runs idle, the
// successor's backend, a kworker, the backend again, then the successor's
// thread), before any event, and with no switch at all. The tasks' times
// add up to the two CPUs' time.
func TestCPUTime(t *testing.T) {
	ev := eventsOf(t, mustRead(t, "testdata/perf.txt"))
	const us = time.Microsecond
	for _, c := range []struct {
		from, to   int64
		want       map[string]time.Duration
		wantBroken int
	}{
		{1_000_010_000, 1_001_500_000, map[string]time.Duration{
			"leaderbench:101": 90 * us,
			"postgres:300":    600 * us,
			"postgres:310":    100 * us,
			"leaderbench:401": 200 * us,
			"swapper/0:0":     500 * us,
			"swapper/1:0":     590 * us,
			"postgres:301":    650 * us,
			"kworker/1:1:50":  50 * us,
			"leaderbench:201": 200 * us,
		}, 1},
		// No switch before: each CPU's first interval is its first
		// switch's task's.
		{998_000_000, 999_800_000, map[string]time.Duration{
			"swapper/0:0":     1000 * us,
			"leaderbench:101": 800 * us,
			"leaderbench:201": 1500 * us,
			"swapper/1:0":     300 * us,
		}, 0},
		// No switch in the time: the tasks of the CPUs' last switches
		// before, or of their first switches after.
		{1_001_600_000, 1_001_900_000, map[string]time.Duration{"swapper/0:0": 300 * us, "swapper/1:0": 300 * us}, 0},
		{998_000_000, 998_500_000, map[string]time.Duration{"swapper/0:0": 500 * us, "leaderbench:201": 500 * us}, 0},
	} {
		got, broken := cpuTime(ev, c.from, c.to)
		var sum time.Duration
		for task, d := range got {
			sum += d
			if c.want[task] != d {
				t.Errorf("%d–%d: %s ran %v; want %v (all: %v)", c.from, c.to, task, d, c.want[task], got)
			}
		}
		if want := 2 * time.Duration(c.to-c.from); sum != want {
			t.Errorf("%d–%d: the tasks ran %v in all; want %v, two CPUs' time", c.from, c.to, sum, want)
		}
		if broken != c.wantBroken {
			t.Errorf("%d–%d: %d intervals after a switch not recorded; want %d", c.from, c.to, broken, c.wantBroken)
		}
	}
}

// TestReadTransfers checks the pairing of releases with the successors'
// Acquires: not one that failed (the successor's, or a follower's), not
// another process's that succeeded (here, of another election), not one
// past the next release (here, a retry of a transfer that failed).
func TestReadTransfers(t *testing.T) {
	trace := `TRACE 100 1 release-to c2 start
TRACE 140 2 acquire end ok=false err=<nil>
TRACE 150 3 acquire end ok=false err=<nil>
TRACE 160 4 acquire end ok=true err=<nil>
TRACE 170 2 acquire end ok=true err=<nil>
TRACE 180 2 elected c2
TRACE 190 4 elected c9
TRACE 300 2 release-to c1 start
TRACE 350 1 acquire end ok=false err=<nil>
TRACE 400 2 release-to c1 start
TRACE 450 1 acquire end ok=true err=<nil>
TRACE 460 1 elected c1
TRACE 120 9 a line out of order
not a trace line
`
	got, unmatched, err := readTransfers(strings.NewReader(trace))
	if err != nil {
		t.Fatal(err)
	}
	want := []transfer{{start: 100, end: 170, to: 2}, {start: 400, end: 450, to: 1}}
	if fmt.Sprint(got) != fmt.Sprint(want) || unmatched != 1 {
		t.Errorf("transfers %v, %d unmatched; want %v, 1", got, unmatched, want)
	}
	if _, _, err := readTransfers(strings.NewReader("TRACE x 1 elected c1\n")); err == nil {
		t.Error("no error for a trace line without its time")
	}
}

// TestReadEventsErrors checks that files gapsched cannot read are errors
// that say why: times in µs (no --ns), and the sched_switch plugin's form.
func TestReadEventsErrors(t *testing.T) {
	for _, c := range []struct{ text, want string }{
		{"     leaderbench   100/101   [000]     1.000050: sched:sched_waking: comm=postgres pid=300 prio=120 target_cpu=000\n", "--ns"},
		{"            perf 25020/25020 [000] 56678.301002713: sched:sched_switch: perf:25020 [120] D ==> migration/0:18 [0]\n", "plugin"},
	} {
		_, _, err := readEvents(strings.NewReader(c.text))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("reading %q: error %v; want one about %s", c.text, err, c.want)
		}
	}
}

// handovers returns a trace and perf script's text, with wake events of
// kind wake, of n transfers between processes 100 and 200 (threads 101
// and 201, backends 300 and 301), one a second. The k-th is m = (7k mod
// n)+1 times 10 µs long in each unit: the old leader's process 1, its
// backend 2, the wait for a CPU 3, the successor's backend 4 and its
// process 5.
func handovers(n int, wake string) (trace, perf string) {
	var tr, pf strings.Builder
	line := func(t int64, comm string, pid, tid, cpu int, event, fields string) {
		fmt.Fprintf(&pf, "%16s %5d/%-5d [%03d] %d.%09d: sched:%s: %s\n", comm, pid, tid, cpu, t/1e9, t%1e9, event, fields)
	}
	switchFields := func(prev string, prevTID int, state, next string, nextTID int) string {
		return fmt.Sprintf("prev_comm=%s prev_pid=%d prev_prio=120 prev_state=%s ==> next_comm=%s next_pid=%d next_prio=120", prev, prevTID, state, next, nextTID)
	}
	wakeFields := func(comm string, tid, cpu int) string {
		return fmt.Sprintf("comm=%s pid=%d prio=120 target_cpu=%03d", comm, tid, cpu)
	}
	for k := 1; k <= n; k++ {
		old, succ, id := 100, 200, "c2"
		if k%2 == 0 {
			old, succ, id = 200, 100, "c1"
		}
		backend := map[int]int{100: 300, 200: 301}
		oldBE, succBE := backend[old], backend[succ]
		start, u := int64(k)*1e9, int64((7*k)%n+1)*10e3
		line(start-1e6, "swapper", 0, 0, 0, "sched_switch", switchFields("swapper/0", 0, "R", "leaderbench", old+1))
		fmt.Fprintf(&tr, "TRACE %d %d release-to %s start\n", start, old, id)
		line(start+u, "leaderbench", old, old+1, 0, wake, wakeFields("postgres", oldBE, 0))
		line(start+u, "leaderbench", old, old+1, 0, "sched_switch", switchFields("leaderbench", old+1, "S", "postgres", oldBE))
		line(start+3*u, "postgres", oldBE, oldBE, 0, wake, wakeFields("postgres", succBE, 1))
		line(start+3*u, "postgres", oldBE, oldBE, 0, "sched_switch", switchFields("postgres", oldBE, "S", "swapper/0", 0))
		line(start+6*u, "swapper", 0, 0, 1, "sched_switch", switchFields("swapper/1", 0, "R", "postgres", succBE))
		line(start+9*u, "postgres", succBE, succBE, 1, wake, wakeFields("leaderbench", succ+1, 1))
		line(start+10*u, "postgres", succBE, succBE, 1, "sched_switch", switchFields("postgres", succBE, "S", "leaderbench", succ+1))
		fmt.Fprintf(&tr, "TRACE %d %d acquire end ok=true err=<nil>\n", start+15*u, succ)
		fmt.Fprintf(&tr, "TRACE %d %d elected %s\n", start+15*u+100, succ, id)
		line(start+15*u+1e6, "leaderbench", succ, succ+1, 1, "sched_switch", switchFields("leaderbench", succ+1, "S", "swapper/1", 0))
	}
	return tr.String(), pf.String()
}

// report1 runs gapsched on the two files, listing the slowest transfer.
func report1(t *testing.T, tracePath, perfPath string) string {
	t.Helper()
	var out strings.Builder
	if err := run(&out, tracePath, perfPath, 1); err != nil {
		t.Fatal(err)
	}
	return out.String()
}

// wantIn checks that the report out has each of wants, and shows it once
// if not; prefix names the case.
func wantIn(t *testing.T, prefix, out string, wants ...string) {
	t.Helper()
	lacks := false
	for _, want := range wants {
		if !strings.Contains(out, want) {
			t.Errorf("%sthe report lacks %q", prefix, want)
			lacks = true
		}
	}
	if lacks {
		t.Logf("%sthe report:\n%s", prefix, out)
	}
}

// eventsOf reads perf script's text.
func eventsOf(t *testing.T, text string) []event {
	t.Helper()
	ev, _, err := readEvents(strings.NewReader(text))
	if err != nil {
		t.Fatal(err)
	}
	return ev
}

// withoutLines returns text without its lines that contain s, which must
// be n.
func withoutLines(t *testing.T, text, s string, n int) string {
	t.Helper()
	var kept []string
	for l := range strings.Lines(text) {
		if !strings.Contains(l, s) {
			kept = append(kept, l)
		}
	}
	if got := strings.Count(text, "\n") - len(kept); got != n {
		t.Fatalf("%d lines contain %q; want %d", got, s, n)
	}
	return strings.Join(kept, "")
}

// mustRead returns the file's text.
func mustRead(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// writeFile writes text to path.
func writeFile(t *testing.T, path, text string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
}
