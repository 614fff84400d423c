package main

import (
	"os"
	"strings"
	"testing"
	"time"
)

// TestSegments checks one transfer's split, from a hand-made trace and
// perf script text (testdata): the old leader's process (100) sends its
// release at 1.000010 s; its backend (300) runs from 1.000100, wakes the
// successor's (301) at 1.000500, which runs from 1.000600 and is switched
// out at 1.001300, after waking the successor's process (200), whose
// Acquire returns at 1.001500.
func TestSegments(t *testing.T) {
	var out strings.Builder
	if err := run(&out, "testdata/trace.log", "testdata/perf.txt", 1); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"1 transfers",
		"| release → old backend runs | 90 | 90 | 90 |",
		"| old backend → wake | 400 | 400 | 400 |",
		"| wake → successor runs | 100 | 100 | 100 |",
		"| successor backend | 700 | 700 | 700 |",
		"| → Acquire returns | 200 | 200 | 200 |",
		"| whole | 1490 | 1490 | 1490 |",
		"old backend postgres:300, successor's postgres:301",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the report lacks %q:\n%s", want, out.String())
		}
	}
}

// TestCPUTime checks the CPU time of each task during the transfer: on
// CPU 0, the old leader's thread until its backend runs, the backend
// until it sleeps, then the idle task; on CPU 1, the idle task, the
// successor's backend, then its process's thread.
func TestCPUTime(t *testing.T) {
	ev := mustEvents(t)
	got := cpuTime(ev, 1_000_010_000, 1_001_500_000)
	want := map[string]time.Duration{
		"leaderbench:101": 90 * time.Microsecond,
		"postgres:300":    600 * time.Microsecond,
		"swapper/0:0":     800 * time.Microsecond,
		"swapper/1:0":     590 * time.Microsecond,
		"postgres:301":    700 * time.Microsecond,
		"leaderbench:201": 200 * time.Microsecond,
	}
	for task, d := range want {
		if got[task] != d {
			t.Errorf("%s ran %v; want %v (all: %v)", task, got[task], d, got)
		}
	}
}

// TestNoTransferInTheEvents checks that transfers outside the events'
// time are left out, and the report says why.
func TestNoTransferInTheEvents(t *testing.T) {
	ev := mustEvents(t)
	if segs := analyze([]transfer{{start: 5e9, end: 5e9 + 1e6, from: 100, to: 200}}, ev); len(segs) != 0 {
		t.Fatalf("segments of a transfer outside the events: %+v", segs)
	}
	var out strings.Builder
	report(&out, nil, ev, 1)
	if !strings.Contains(out.String(), "no transfer") {
		t.Errorf("report of nothing: %q", out.String())
	}
}

func mustEvents(t *testing.T) []event {
	t.Helper()
	f := strings.NewReader(mustRead(t, "testdata/perf.txt"))
	ev, err := readEvents(f)
	if err != nil {
		t.Fatal(err)
	}
	if len(ev) != 11 {
		t.Fatalf("read %d events; want 11", len(ev))
	}
	return ev
}

func mustRead(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
