package faults_test

import (
	"cmp"
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/leaderelect/leader/internal/history"
	"github.com/leaderelect/leader/internal/pgtest"
	"github.com/leaderelect/leader/postgres"
)

// envSoak names the environment variable that turns soak mode on.
const envSoak = "LEADER_SOAK"

// strategies are the PostgreSQL strategies every fault runs on.
var strategies = []string{"lease", "advisory"}

// soak is how long soak mode runs (LEADER_SOAK), or 0 in CI mode; set by
// TestMain.
var soak time.Duration

// suite adds up the results of every scenario of every test, for the table
// TestMain prints in soak mode.
var suite = &tally{results: map[[2]string]*result{}}

func TestMain(m *testing.M) {
	if v := os.Getenv(envSoak); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			fmt.Fprintf(os.Stderr, "%s=%q: want a positive Go duration such as 30m\n", envSoak, v)
			os.Exit(2)
		}
		soak = d
	}
	if os.Getenv(childURL) == "" { // not a candidate's process: see process_test.go
		p, err := startStallProbe(postgres.DefaultTakeoverGrace)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		probe = p
	}
	start := time.Now()
	// toxiproxy v2.12 can leave a link's no-op toxic blocked for good on
	// its output when the proxy is stopped (see heal) while the link
	// carries data its writer, already gone, will never read: a goroutine
	// of toxiproxy's that nothing of ours can end. Seen once in a
	// 30-minute soak.
	code := pgtest.Run(runThenStopProbe{m},
		goleak.IgnoreTopFunction("github.com/Shopify/toxiproxy/v2/toxics.(*NoopToxic).Pipe"))
	if soak > 0 {
		fmt.Printf("\nFaults, soak of %v (ran %v):\n\n%s\n%s\n", soak, time.Since(start).Round(time.Second), suite.markdown(), probe.summary())
	}
	os.Exit(code)
}

// runThenStopProbe runs the tests, then stops the stall probe before
// pgtest looks for leaked goroutines.
type runThenStopProbe struct{ m *testing.M }

func (r runThenStopProbe) Run() int {
	defer func() {
		if probe != nil {
			probe.stop()
		}
	}()
	return r.m.Run()
}

// result is what one scenario, or a tally of them, found.
type result struct {
	trials, overlaps, termRegressions int
	// staleRefused and staleAccepted count the writes to the fenced
	// register made with a deposed leader's term after its successor had
	// written: refused (as they must be) and accepted (a failure).
	staleRefused, staleAccepted int
	// fenceTx counts the transactions fenced with postgres.Fence made
	// with a term after it lost its lease (process and promotion
	// faults).
	fenceTx   staleTx
	takeovers []time.Duration
}

func (r *result) add(o result) {
	r.trials += o.trials
	r.overlaps += o.overlaps
	r.termRegressions += o.termRegressions
	r.staleRefused += o.staleRefused
	r.staleAccepted += o.staleAccepted
	r.fenceTx.add(o.fenceTx)
	r.takeovers = append(r.takeovers, o.takeovers...)
}

// tally adds up results per fault and strategy.
type tally struct {
	mu      sync.Mutex
	results map[[2]string]*result
}

func (ta *tally) add(fault, strategy string, r result) {
	ta.mu.Lock()
	defer ta.mu.Unlock()
	key := [2]string{fault, strategy}
	if ta.results[key] == nil {
		ta.results[key] = &result{}
	}
	ta.results[key].add(r)
}

// markdown returns the tally as a markdown table, sorted by fault and
// strategy.
func (ta *tally) markdown() string {
	ta.mu.Lock()
	defer ta.mu.Unlock()
	var b strings.Builder
	b.WriteString("| fault | strategy | trials | overlaps | term regressions | stale writes refused | stale writes accepted | stale Fence tx attempted | stale Fence tx refused | stale Fence tx accepted | stale Fence tx failed | takeovers | takeover p50 | takeover p99 | takeover max |\n")
	b.WriteString("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	keys := slices.SortedFunc(maps.Keys(ta.results), func(a, b [2]string) int {
		return cmp.Or(cmp.Compare(a[0], b[0]), cmp.Compare(a[1], b[1]))
	})
	for _, key := range keys {
		b.WriteString(row(key[0], key[1], *ta.results[key]) + "\n")
	}
	return b.String()
}

// row returns r as a row of the markdown table that tally.markdown prints.
func row(fault, strategy string, r result) string {
	p50, p99, most := "–", "–", "–" // no takeover: the leader led on
	if len(r.takeovers) > 0 {
		sum := history.Summarize(r.takeovers)
		round := func(d time.Duration) string { return d.Round(time.Millisecond).String() }
		p50, p99, most = round(sum.P50), round(sum.P99), round(sum.Max)
	}
	return fmt.Sprintf("| %s | %s | %d | %d | %d | %d | %d | %s | %d | %s | %s | %s |",
		fault, strategy, r.trials, r.overlaps, r.termRegressions, r.staleRefused, r.staleAccepted,
		staleTxCells(r.fenceTx), len(r.takeovers), p50, p99, most)
}

// rounds runs round(t, trials) once in CI mode, and over and over until
// the soak ends in soak mode, each time as a subtest; trials is ciTrials
// or soakTrials. It stops early once a round fails.
func rounds(t *testing.T, ciTrials, soakTrials int, round func(t *testing.T, trials int)) {
	trials := ciTrials
	if soak > 0 {
		trials = soakTrials
	}
	deadline := time.Now().Add(soak)
	for n := 1; ; n++ {
		t.Run(fmt.Sprint("round ", n), func(t *testing.T) { round(t, trials) })
		if soak == 0 || t.Failed() || time.Now().After(deadline) {
			return
		}
	}
}

// record adds r to the suite's tally and logs its row.
func record(t *testing.T, fault, strategy string, r result) {
	suite.add(fault, strategy, r)
	t.Log(row(fault, strategy, r))
}
