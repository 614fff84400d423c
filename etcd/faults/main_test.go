//go:build unix

package faults_test

import (
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
)

// envSoak names the environment variable that turns soak mode on: a Go
// duration.
const envSoak = "LEADER_SOAK_ETCD"

// ciTrials and soakTrials are the trials of each scenario in CI mode, and
// in each round of soak mode.
const (
	ciTrials   = 2
	soakTrials = 6
)

// soak is how long soak mode runs, or 0 in CI mode; set by TestMain.
var soak time.Duration

// suite adds up the results of every scenario, for the table TestMain
// prints in soak mode.
var suite = &tally{results: map[string]*result{}}

func TestMain(m *testing.M) {
	if v := os.Getenv(envSoak); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			fmt.Fprintf(os.Stderr, "%s=%q: want a positive Go duration such as 30m\n", envSoak, v)
			os.Exit(2)
		}
		soak = d
	}
	start := time.Now()
	// toxiproxy v2.12 can leave a link's no-op toxic blocked for good on
	// its output, when the connection it writes to fails while more data
	// is on its way (a client closed while its member sends, say): a
	// goroutine of toxiproxy's that nothing of ours can end. The toxics
	// of this package never block the no-op toxic before them.
	code := pgtest.Run(m, goleak.IgnoreTopFunction("github.com/Shopify/toxiproxy/v2/toxics.(*NoopToxic).Pipe"))
	if soak > 0 {
		fmt.Printf("\netcd faults, soak of %v (ran %v):\n\n%s\n", soak, time.Since(start).Round(time.Second), suite.markdown())
	}
	os.Exit(code)
}

// tally adds up results per scenario.
type tally struct {
	mu      sync.Mutex
	results map[string]*result
}

func (ta *tally) add(scenario string, r result) {
	ta.mu.Lock()
	defer ta.mu.Unlock()
	if ta.results[scenario] == nil {
		ta.results[scenario] = &result{}
	}
	ta.results[scenario].add(r)
}

func (ta *tally) markdown() string {
	ta.mu.Lock()
	defer ta.mu.Unlock()
	var b strings.Builder
	b.WriteString(header + "\n")
	for _, k := range slices.Sorted(maps.Keys(ta.results)) {
		b.WriteString(row(k, *ta.results[k]) + "\n")
	}
	return b.String()
}

const header = "| scenario | trials | led on | lost without a fault | overlaps | term regressions | terms granted twice | stale writes refused | stale writes accepted | takeovers | takeover p50 | takeover p99 | takeover max |\n" +
	"|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"

// row returns r as a row of the markdown table.
func row(scenario string, r result) string {
	p50, p99, most := "–", "–", "–"
	if len(r.takeovers) > 0 {
		s := history.Summarize(r.takeovers)
		round := func(d time.Duration) string { return d.Round(time.Millisecond).String() }
		p50, p99, most = round(s.P50), round(s.P99), round(s.Max)
	}
	return fmt.Sprintf("| %s | %d | %d | %d | %d | %d | %d | %d | %d | %d | %s | %s | %s |",
		scenario, r.trials, r.ledOn, r.unprovoked, r.overlaps, r.termRegressions, r.termsGrantedTwice,
		r.staleRefused, r.staleAccepted, len(r.takeovers), p50, p99, most)
}

// record adds r to the suite's tally and logs its row.
func record(t *testing.T, scenario string, r result) {
	suite.add(scenario, r)
	t.Log(row(scenario, r))
}

// rounds runs round(t, trials) once in CI mode, and over and over until
// the soak ends in soak mode, each time as a subtest. It stops early once
// a round fails.
func rounds(t *testing.T, round func(t *testing.T, trials int)) {
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
