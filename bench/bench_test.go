package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// The test binary is also the candidate processes' binary: a child runs
// childMain instead of the tests.
func TestMain(m *testing.M) {
	if role := os.Getenv(envRole); role != "" {
		os.Exit(childMain(role))
	}
	os.Exit(m.Run())
}

// A minimal run of every setup and of the idle cost, against a throwaway
// cluster (or LEADER_TEST_DATABASE_URL) and an embedded etcd: each elector
// kind elects, hands over gracefully, survives a killed (or black-holed)
// leader, is counted at steady state, and reports its idle cost; ours
// (on etcd too) also transfer to named followers; ours on PostgreSQL
// also go through two rolling deploys
// (the leader replaced first, then in the middle), each of which must move
// leadership exactly once; the lease strategy also holds 500 names in one
// process and runs 5 processes × 10 names, and the etcd store holds 500
// names in one process (short windows). It catches
// breakage of the harness and of the peers' adapters, not performance.
func TestSmoke(t *testing.T) {
	p := quickPlan()
	p.followers, p.graceful, p.crash, p.transfer, p.deploys = 2, 2, 1, 2, 2
	p.loadWindow = func(t timing) time.Duration { return t.TTL.D() }
	p.idleN, p.idleNAdvisory = 10, 5
	p.scaleNames, p.scaleNamesWindow = 500, 8*time.Second
	p.scaleProcs, p.scaleProcNames, p.scaleProcsWindow = 5, 10, 8*time.Second
	p.floorTrials = 5
	out := filepath.Join(t.TempDir(), "results.json")
	o := options{out: out, databaseURL: os.Getenv("LEADER_TEST_DATABASE_URL")}
	var stdout, stderr bytes.Buffer
	code := runBench(o, p, &stdout, &stderr)
	t.Logf("stderr:\n%s", stderr.String())
	t.Logf("stdout:\n%s", stdout.String())
	if code != 0 {
		t.Fatalf("bench exited with %d", code)
	}

	js, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	var rep report
	if err := json.Unmarshal(js, &rep); err != nil {
		t.Fatalf("the JSON does not parse: %v", err)
	}
	seen := map[string]bool{}
	for _, r := range rep.Results {
		seen[r.Kind+" "+r.Scenario] = true
		if r.Error != "" {
			t.Errorf("%s %s: %s", r.Setup, r.Scenario, r.Error)
		}
		switch r.Scenario {
		case scGraceful, scCrash, scBlackHole, scTransfer:
			if r.Summary == nil || r.Summary.N != r.Trials || r.Failures != 0 {
				t.Errorf("%s %s: %d of %d trials measured, %d failed", r.Setup, r.Scenario, len(r.SamplesMs), r.Trials, r.Failures)
			}
			if r.Scenario == scTransfer && len(r.SeriesMs[seriesCommandToElected]) != len(r.SamplesMs) {
				t.Errorf("%s: %d gaps but %d times from the command: %v", r.Setup, len(r.SamplesMs), len(r.SeriesMs[seriesCommandToElected]), r.SeriesMs)
			}
		case scRolling:
			if len(r.Deploys) != p.deploys || r.Summary == nil {
				t.Errorf("%s: %d of %d deploys measured", r.Setup, len(r.Deploys), p.deploys)
			}
			for i, d := range r.Deploys {
				if !d.exactlyOnce() {
					t.Errorf("%s: deploy %d did not move leadership exactly once, to the new release: %+v", r.Setup, i, d)
				}
			}
		case scFloor:
			for _, series := range []string{seriesRoundTrip, seriesLockWake, seriesHandover} {
				if n := len(r.SeriesMs[series]); n != p.floorTrials {
					t.Errorf("%s: %d of %d trials of %s measured", r.Setup, n, p.floorTrials, series)
				}
			}
		case scLoad:
			if r.Values["leader_stmts_per_s"] <= 0 {
				t.Errorf("%s: the leader sent nothing during the load window: %v", r.Setup, r.Values)
			}
		case scIdle:
			if r.Values["goroutines_per_elector"] <= 0 {
				t.Errorf("%s: idle followers cost no goroutine: %v", r.Setup, r.Values)
			}
		case scScaleNames:
			v := r.Values
			if v["renew_statements"] <= 0 || v["rounds_observed"] <= 0 || r.Summary == nil || len(r.Rounds) == 0 {
				t.Errorf("%s: no renew rounds measured: %v", r.Setup, v)
			}
			if v["names"] != float64(p.scaleNames) || v["leaders_at_end"] != v["names"] || v["server_leases_held"] != v["names"] {
				t.Errorf("%s: not every name led at the end: %v", r.Setup, v)
			}
		case scScaleProcs:
			v := r.Values
			if v["processes"] != float64(p.scaleProcs) || v["leaders_per_name_min"] != 1 || v["leaders_per_name_max"] != 1 || v["server_leases_held"] != v["names"] {
				t.Errorf("%s: not exactly one leader per name: %v", r.Setup, v)
			}
			if v["leader_stmts_per_round_mean"] <= 0 || v["follower_stmts_per_ttl"] <= 0 {
				t.Errorf("%s: leaders or followers sent nothing: %v", r.Setup, v)
			}
		}
	}
	for _, sc := range []string{scScaleNames, scScaleProcs} {
		if !seen[kindLease+" "+sc] {
			t.Errorf("no %s result", sc)
		}
	}
	if !seen[kindLeaderEtcd+" "+scScaleNames] {
		t.Errorf("no %s result for %s", scScaleNames, kindLeaderEtcd)
	}
	for _, kind := range allKinds {
		for _, sc := range []string{scLoad, scGraceful, scCrash, scIdle} {
			if !seen[kind+" "+sc] {
				t.Errorf("no %s result for %s", sc, kind)
			}
		}
	}
	for _, kind := range []string{kindLease, kindAdvisory} {
		for _, sc := range []string{scTransfer, scRolling} {
			if !seen[kind+" "+sc] {
				t.Errorf("no %s result for %s", sc, kind)
			}
		}
	}
	if !seen[kindLeaderEtcd+" "+scTransfer] {
		t.Errorf("no %s result for %s", scTransfer, kindLeaderEtcd)
	}
	if !strings.Contains(stdout.String(), "| leader, etcd store |") {
		t.Errorf("the markdown has no row for %s", kindLeaderEtcd)
	}
	if !seen["postgres "+scFloor] {
		t.Errorf("no floor result")
	}
	if !seen[kindAdvisory+" "+scBlackHole] {
		t.Errorf("no black-hole result for the advisory strategy")
	}
	for _, heading := range []string{"### Handover and takeover", "### Handing over on purpose", "### Steady-state load", "### Idle followers", "### Scale: many names", "### Scale: many processes", "### The floor", "### Targets"} {
		if !strings.Contains(stdout.String(), heading) {
			t.Errorf("the markdown has no %q table", heading)
		}
	}
}
