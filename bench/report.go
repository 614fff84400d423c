package main

import (
	"context"
	"fmt"
	"io"
	"math"
	"os"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"time"
)

// summary summarizes latency samples, in milliseconds. Percentiles are
// nearest-rank: p99 of fewer than 100 samples is the largest but
// ceil(n/100)-1.
type summary struct {
	N    int     `json:"n"`
	Min  float64 `json:"min"`
	P50  float64 `json:"p50"`
	P90  float64 `json:"p90"`
	P99  float64 `json:"p99"`
	Max  float64 `json:"max"`
	Mean float64 `json:"mean"`
}

func percentile(sorted []float64, p float64) float64 {
	i := int(math.Ceil(p*float64(len(sorted)))) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

func summarize(samples []float64) summary {
	s := slices.Clone(samples)
	slices.Sort(s)
	sum := 0.0
	for _, v := range s {
		sum += v
	}
	return summary{
		N: len(s), Min: s[0], P50: percentile(s, 0.5), P90: percentile(s, 0.9),
		P99: percentile(s, 0.99), Max: s[len(s)-1], Mean: sum / float64(len(s)),
	}
}

// machine describes where the run ran.
type machine struct {
	OS          string            `json:"os"`
	Arch        string            `json:"arch"`
	CPUs        int               `json:"cpus"`
	CPUModel    string            `json:"cpu_model,omitempty"`
	GoVersion   string            `json:"go_version"`
	PostgreSQL  string            `json:"postgresql"`
	Statements  bool              `json:"pg_stat_statements"`
	Throwaway   bool              `json:"throwaway_cluster"`
	Deps        map[string]string `json:"deps"`
	Concurrency string            `json:"note"`
}

func describeMachine(ctx context.Context, db *database) machine {
	m := machine{
		OS: runtime.GOOS, Arch: runtime.GOARCH, CPUs: runtime.NumCPU(), GoVersion: runtime.Version(),
		Statements: db.statements, Throwaway: db.cluster != nil, Deps: map[string]string{},
		Concurrency: "every candidate is its own process on this machine, as are the PostgreSQL server and its backends; the embedded etcd and the proxies run in the bench process",
	}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPUModel = strings.TrimSpace(v)
				break
			}
		}
	}
	_ = db.admin.QueryRow(ctx, "SELECT version()").Scan(&m.PostgreSQL)
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, d := range bi.Deps {
			switch d.Path {
			case "k8s.io/client-go", "go.etcd.io/etcd/server/v3", "go.etcd.io/etcd/client/v3", "github.com/jackc/pgx/v5", "github.com/Shopify/toxiproxy/v2":
				m.Deps[d.Path] = d.Version
			}
		}
	}
	return m
}

// target is one of issue 6's targets, with the measured value.
type target struct {
	What     string  `json:"what"`
	Setup    string  `json:"setup"`
	Limit    float64 `json:"limit"`
	Measured float64 `json:"measured"`
	Unit     string  `json:"unit"`
	Met      bool    `json:"met"`
	Missing  bool    `json:"missing,omitempty"`
}

func find(results []Result, scenario, kind string, defaults bool) *Result {
	for i := range results {
		r := &results[i]
		if r.Scenario == scenario && r.Kind == kind && r.Defaults == defaults && r.Error == "" {
			return r
		}
	}
	return nil
}

func evaluateTargets(results []Result) []target {
	var out []target
	add := func(what, setup string, limit, measured float64, unit string, ok bool) {
		out = append(out, target{What: what, Setup: setup, Limit: limit, Measured: measured, Unit: unit, Met: ok && measured <= limit, Missing: !ok})
	}
	for _, kind := range []string{kindLease, kindAdvisory} {
		if r := find(results, scGraceful, kind, false); r != nil && r.Summary != nil {
			add("graceful handover p99 ≤ 25 ms", r.Setup, 25, r.Summary.P99, "ms", true)
		}
	}
	if r := find(results, scCrash, kindLease, false); r != nil && r.Summary != nil {
		limit := float64(r.Timing.TTL.D().Milliseconds()) + 100
		add("lease crash takeover p99 ≤ TTL + 100 ms", r.Setup, limit, r.Summary.P99, "ms", true)
	}
	if r := find(results, scCrash, kindAdvisory, false); r != nil && r.Summary != nil {
		add("advisory takeover after kill p99 ≤ 100 ms", r.Setup, 100, r.Summary.P99, "ms", true)
	}
	for _, kind := range []string{kindLease, kindAdvisory} {
		if r := find(results, scLoad, kind, false); r != nil {
			add("follower ≤ 1 statement per TTL", r.Setup, 1, r.Values["follower_stmts_per_ttl"], "statements/TTL", true)
			add("leader ≤ 1 statement per renew interval", r.Setup, 1, r.Values["leader_stmts_per_renew"], "statements/renew interval", true)
		}
	}
	etcd := find(results, scGraceful, kindEtcd, false)
	for _, kind := range []string{kindLease, kindAdvisory, kindLeaderEtcd} {
		if r := find(results, scGraceful, kind, false); r != nil && r.Summary != nil && etcd != nil && etcd.Summary != nil {
			what := fmt.Sprintf("graceful handover p99 below etcd's (%s ms, same run)", fmtMs(etcd.Summary.P99))
			add(what, r.Setup, etcd.Summary.P99, r.Summary.P99, "ms", true)
			out[len(out)-1].Met = r.Summary.P99 < etcd.Summary.P99
		}
		if kind == kindLeaderEtcd {
			continue // issue 18's transfer and deploy targets are the PostgreSQL stores'
		}
		if r := find(results, scTransfer, kind, false); r != nil && r.Summary != nil {
			add("transfer: leaderless gap p99 ≤ 2 ms", r.Setup, 2, r.Summary.P99, "ms", true)
		}
		if r := find(results, scRolling, kind, false); r != nil && len(r.Deploys) > 0 {
			add("rolling deploy: leadership changes exactly once, to the new release", r.Setup, 0,
				r.Values["deploys"]-r.Values["exactly_once"], fmt.Sprintf("of %.0f deploys did not", r.Values["deploys"]), true)
			add("rolling deploy: longest leaderless gap ≤ 2 ms", r.Setup, 2, r.Summary.Max, "ms", true)
		}
	}
	if r := find(results, scScaleNames, kindLease, false); r != nil {
		names := fmt.Sprintf("%s names in one process", thousands(r.Values["names"]))
		add(names+": one statement per renew round", r.Setup, 1, r.Values["statements_per_round"], "statements/round", true)
		if r.Summary != nil {
			add(names+": round p99 ≤ 50 ms", r.Setup, 50, r.Summary.P99, "ms", true)
		}
		add(names+": zero spurious losses", r.Setup, 0, r.Values["losses"], "losses", true)
	}
	if r := find(results, scScaleNames, kindLeaderEtcd, false); r != nil {
		names := fmt.Sprintf("%s names in one process, etcd store", thousands(r.Values["names"]))
		add(names+": one keep-alive per renew round", r.Setup, 1, r.Values["statements_per_round"], "keep-alives/round", true)
		add(names+": zero spurious losses", r.Setup, 0, r.Values["losses"], "losses", true)
	}
	return out
}

// label names a setup for the tables.
func label(r *Result) string {
	kind := map[string]string{
		kindLease: "leader, lease", kindAdvisory: "leader, advisory", kindSkill: "skill (table + heartbeat)",
		kindClientGo: "client-go LeaderElector", kindEtcd: "etcd concurrency.Election",
		kindLeaderEtcd: "leader, etcd store",
	}[r.Kind]
	if r.Defaults {
		return kind + ", its defaults"
	}
	return kind
}

func timingCell(t timing, kind string) string {
	d := func(x duration) string { return shortDur(x.D()) }
	switch kind {
	case kindSkill:
		return fmt.Sprintf("timeout %s, heartbeat %s", d(t.TTL), d(t.Renew))
	case kindClientGo:
		return fmt.Sprintf("lease %s, renew deadline %s, retry %s", d(t.TTL), d(t.RenewDeadline), d(t.Renew))
	case kindEtcd:
		return fmt.Sprintf("session TTL %s (keep-alive %s)", d(t.TTL), d(t.Renew))
	case kindLeaderEtcd:
		// The store's etcd lease: whole seconds, at least etcd's minimum.
		return fmt.Sprintf("TTL %s, renew %s (etcd lease %ds)", d(t.TTL), d(t.Renew), etcdLeaseSeconds(t.TTL.D()))
	}
	return fmt.Sprintf("TTL %s, renew %s", d(t.TTL), d(t.Renew))
}

func shortDur(d time.Duration) string {
	if d%time.Second == 0 {
		return fmt.Sprintf("%ds", int(d/time.Second))
	}
	return d.Round(time.Millisecond).String()
}

func latencyCell(r *Result) string {
	if r == nil {
		return "–"
	}
	if r.Summary == nil {
		if r.Error != "" {
			return "failed"
		}
		return "–"
	}
	s := r.Summary
	cell := fmt.Sprintf("%s / %s / %s (n=%d)", fmtMs(s.P50), fmtMs(s.P99), fmtMs(s.Max), s.N)
	if r.Failures > 0 {
		cell += fmt.Sprintf(", %d failed", r.Failures)
	}
	return cell
}

func fmtMs(v float64) string {
	switch {
	case v >= 10000:
		return fmt.Sprintf("%.1f s", v/1000)
	case v >= 100:
		return fmt.Sprintf("%.0f", v)
	default:
		return fmt.Sprintf("%.1f", v)
	}
}

func rate(v float64) string {
	switch {
	case v == 0:
		return "0"
	case v < 0.1:
		return fmt.Sprintf("%.3f", v)
	default:
		return fmt.Sprintf("%.2f", v)
	}
}

func writeMarkdown(w io.Writer, rep *report) {
	results := rep.Results
	setupOrder := []string{}
	bySetup := map[string]map[string]*Result{}
	for i := range results {
		r := &results[i]
		if bySetup[r.Setup] == nil {
			bySetup[r.Setup] = map[string]*Result{}
			setupOrder = append(setupOrder, r.Setup)
		}
		bySetup[r.Setup][r.Scenario] = r
	}
	any := func(m map[string]*Result) *Result {
		for _, r := range m {
			return r
		}
		return nil
	}

	fmt.Fprintf(w, "## Leader election benchmark (%s mode)\n\n", rep.Mode)
	fmt.Fprintf(w, "%s; %d CPUs (%s); %s; Go %s. Wall time %.0f s.\n\n",
		rep.Started.Format(time.RFC3339), rep.Machine.CPUs, rep.Machine.CPUModel, firstWords(rep.Machine.PostgreSQL, 2), rep.Machine.GoVersion, rep.WallSec)

	has := func(scenarios ...string) bool {
		for i := range results {
			if slices.Contains(scenarios, results[i].Scenario) {
				return true
			}
		}
		return false
	}
	if has(scGraceful, scCrash, scBlackHole) {
		fmt.Fprintln(w, "### Handover and takeover (ms: p50 / p99 / max, n trials)")
		fmt.Fprintln(w)
		fmt.Fprintln(w, "| Elector | Timing | Followers | Graceful handover | Crash takeover | Crash p99 ÷ TTL |")
		fmt.Fprintln(w, "|---|---|---|---|---|---|")
	}
	for _, name := range setupOrder {
		m := bySetup[name]
		r := any(m)
		if m[scGraceful] == nil && m[scCrash] == nil && m[scBlackHole] == nil {
			continue
		}
		crash := m[scCrash]
		crashLabel := ""
		if crash == nil && m[scBlackHole] != nil {
			crash = m[scBlackHole]
		}
		lbl := label(r)
		switch {
		case m[scBlackHole] != nil:
			lbl += ", leader's connections black-holed"
		case r.Kind == kindAdvisory && crash != nil:
			lbl += ", leader's process killed"
		}
		ratio := "–"
		if crash != nil && crash.Summary != nil {
			ratio = fmt.Sprintf("%.2f", crash.Summary.P99/float64(crash.Timing.TTL.D().Milliseconds()))
		}
		if crash != nil && crash.Defaults && crash.Trials > 0 && crash.Trials < 10 {
			crashLabel = " (few trials: one takes a default TTL)"
		}
		fmt.Fprintf(w, "| %s | %s | %d | %s | %s%s | %s |\n", lbl, timingCell(r.Timing, r.Kind), r.Followers,
			latencyCell(m[scGraceful]), latencyCell(crash), crashLabel, ratio)
	}
	if has(scTransfer, scRolling) {
		writeHandingOver(w, results, setupOrder, bySetup)
	}
	if has(scLoad) {
		fmt.Fprintln(w)
		fmt.Fprintln(w, "### Steady-state load (statements per second, per process)")
		fmt.Fprintln(w)
		fmt.Fprintln(w, "| Elector | Timing | Leader | Each follower (mean / max) | Leader per renew interval | Follower per TTL | Server: leader / follower | Server: all statements, transactions vs client |")
		fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|")
	}
	for _, name := range setupOrder {
		r := bySetup[name][scLoad]
		if r == nil {
			continue
		}
		if r.Error != "" {
			fmt.Fprintf(w, "| %s | %s | failed: %s |||||||\n", label(r), timingCell(r.Timing, r.Kind), r.Error)
			continue
		}
		v := r.Values
		server, all := "–", "–"
		if usesEtcd(r.Kind) {
			all = fmt.Sprintf("%s requests vs %s (etcd metrics)", rate(v["server_requests_per_s"]), rate(v["client_stmts_per_s"]))
		} else {
			if _, ok := v["server_leader_stmts_per_s"]; ok {
				server = fmt.Sprintf("%s / %s", rate(v["server_leader_stmts_per_s"]), rate(v["server_follower_stmts_per_s"]))
				all = fmt.Sprintf("%s stmts, %s xacts vs %s", rate(v["server_stmts_per_s"]), rate(v["server_xacts_per_s"]), rate(v["client_stmts_per_s"]))
			} else {
				all = fmt.Sprintf("%s xacts vs %s", rate(v["server_xacts_per_s"]), rate(v["client_stmts_per_s"]))
			}
		}
		fmt.Fprintf(w, "| %s | %s | %s | %s / %s | %.2f | %.2f | %s | %s |\n", label(r), timingCell(r.Timing, r.Kind),
			rate(v["leader_stmts_per_s"]), rate(v["follower_stmts_per_s"]), rate(v["follower_stmts_per_s_max"]),
			v["leader_stmts_per_renew"], v["follower_stmts_per_ttl"], server, all)
	}
	fmt.Fprintln(w)

	if has(scIdle) {
		fmt.Fprintln(w, "### Idle followers in one process (at each kind's default timing)")
		fmt.Fprintln(w)
		fmt.Fprintln(w, "| Elector | N | Heap in use per elector | Goroutines per elector | Server connections per elector (in all) | Notes |")
		fmt.Fprintln(w, "|---|---|---|---|---|---|")
		for i := range results {
			r := &results[i]
			if r.Scenario != scIdle {
				continue
			}
			if r.Error != "" {
				fmt.Fprintf(w, "| %s | – | failed: %s |||||\n", label(r), r.Error)
				continue
			}
			v := r.Values
			conns := "–"
			if c, ok := v["server_connections_per_elector"]; ok {
				conns = fmt.Sprintf("%.3f (%.0f)", c, c*float64(r.Followers))
			}
			fmt.Fprintf(w, "| %s | %d | %s | %.2f | %s | %s |\n", strings.TrimSuffix(label(r), ", its defaults"), r.Followers,
				bytesCell(v["heap_inuse_bytes_per_elector"]), v["goroutines_per_elector"], conns, strings.Join(r.Notes, "; "))
		}
		fmt.Fprintln(w)
	}

	if has(scHerd) {
		fmt.Fprintln(w, "### Many followers at one release (one process, one store)")
		fmt.Fprintln(w)
		fmt.Fprintln(w, "| Elector | Timing | Followers | Stop → successor elected (ms: p50 / p99 / max) | Acquire attempts per handover (mean / max) | Statements per handover (mean) |")
		fmt.Fprintln(w, "|---|---|---|---|---|---|")
		for i := range results {
			r := &results[i]
			if r.Scenario != scHerd {
				continue
			}
			if r.Error != "" {
				fmt.Fprintf(w, "| %s | %s | %d | failed: %s |||\n", label(r), timingCell(r.Timing, r.Kind), r.Followers, r.Error)
				continue
			}
			v := r.Values
			fmt.Fprintf(w, "| %s | %s | %d | %s | %.1f / %.0f | %.1f |\n", label(r), timingCell(r.Timing, r.Kind), r.Followers,
				latencyCell(r), v["acquires_per_handover_mean"], v["acquires_per_handover_max"], v["statements_per_handover_mean"])
		}
		fmt.Fprintln(w)
	}

	if has(scScaleNames) {
		fmt.Fprintln(w, "### Scale: many names in one process (lease strategy; leader, etcd store: a renewal statement is a lease keep-alive, server counts are etcd's requests)")
		fmt.Fprintln(w)
		fmt.Fprintln(w, "| Setup | Timing | Names | All led after | Window (machine's CPU busy) | Renewal statements per round (rounds split; window: statements ÷ window/RenewInterval) | Round latency (ms: p50 / p99 / max, n rounds) | Round, p50 (ms): calls arrive over; first call to statement; statement; outcomes handed out | Statement latency (ms: p50 / p99 / max; server mean) | Spurious losses (leading at end; server: leases held) | Statements per second (client / server) |")
		fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|---|---|---|")
		for i := range results {
			r := &results[i]
			if r.Scenario != scScaleNames {
				continue
			}
			if r.Error != "" {
				fmt.Fprintf(w, "| %s | %s | – | failed: %s ||||||||\n", r.Setup, timingCell(r.Timing, r.Kind), r.Error)
				continue
			}
			v := r.Values
			server := "–"
			if _, ok := v["server_stmts_per_s"]; ok {
				server = rate(v["server_stmts_per_s"])
			}
			stmt := fmt.Sprintf("%s / %s / %s", fmtMs(v["stmt_p50_ms"]), fmtMs(v["stmt_p99_ms"]), fmtMs(v["stmt_max_ms"]))
			if m, ok := v["server_renew_mean_ms"]; ok {
				stmt += fmt.Sprintf("; %s", fmtMs(m))
			}
			breakdown := fmt.Sprintf("%s; %s; %s; %s", fmtMs(v["round_spread_p50_ms"]), fmtMs(v["round_wait_p50_ms"]), fmtMs(v["stmt_p50_ms"]), fmtMs(v["round_hand_out_p50_ms"]))
			perRound := fmt.Sprintf("%.2f (%.0f of %.0f split; %.0f ÷ %.1f)", v["statements_per_round"], v["rounds_split"], v["rounds_observed"], v["renew_statements"], v["rounds"])
			if r.Kind == kindLeaderEtcd {
				perRound = fmt.Sprintf("%.2f keep-alives (%.0f of %.0f split; %.0f ÷ %.1f); all requests: %.2f per round",
					v["statements_per_round"], v["rounds_split"], v["rounds_observed"], v["renew_statements"], v["rounds"], v["requests_per_round_window"])
			}
			fmt.Fprintf(w, "| %s | %s | %s | %.1f s (losses: %.0f meanwhile, %.0f before the window) | %s | %s | %s | %s | %s | %.0f (%.0f; %.0f) | %s / %s |\n",
				r.Setup, timingCell(r.Timing, r.Kind), thousands(v["names"]), v["lead_all_s"], v["startup_losses"], v["losses_before_window"], windowCell(v),
				perRound, latencyCell(r), breakdown, stmt,
				v["losses"], v["leaders_at_end"], v["server_leases_held"], rate(v["client_stmts_per_s"]), server)
		}
		fmt.Fprintln(w)
	}
	if has(scScaleProcs) {
		fmt.Fprintln(w, "### Scale: many processes campaigning for the same names (lease strategy)")
		fmt.Fprintln(w)
		fmt.Fprintln(w, "| Setup | Timing | Processes × names | All led after | Window (machine's CPU busy) | Leaders per name (min / max; server: leases held) | Leadership changes in the window (between every name led and the window) | Statements per second: all (client / server), per process (mean / max) | Leader statements per renew round, per leading process (mean / max; processes leading) | Follower statements per TTL, per follower Elector (mean / max of processes) | Process RSS (mean / max) |")
		fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|---|---|---|")
		for i := range results {
			r := &results[i]
			if r.Scenario != scScaleProcs {
				continue
			}
			if r.Error != "" {
				fmt.Fprintf(w, "| %s | %s | – | failed: %s ||||||||\n", r.Setup, timingCell(r.Timing, r.Kind), r.Error)
				continue
			}
			v := r.Values
			server := "–"
			if _, ok := v["server_stmts_per_s"]; ok {
				server = rate(v["server_stmts_per_s"])
			}
			rss := "–"
			if _, ok := v["process_rss_mib_mean"]; ok {
				rss = fmt.Sprintf("%.0f / %.0f MiB", v["process_rss_mib_mean"], v["process_rss_mib_max"])
			}
			fmt.Fprintf(w, "| %s | %s | %.0f × %.0f | %.1f s | %s | %.0f / %.0f; %.0f | %.0f (%.0f) | %s / %s; %s / %s | %.2f / %.2f; %.0f | %.2f / %.2f | %s |\n",
				r.Setup, timingCell(r.Timing, r.Kind), v["processes"], v["names"], v["all_led_s"], windowCell(v),
				v["leaders_per_name_min"], v["leaders_per_name_max"], v["server_leases_held"], v["leadership_changes"], v["changes_before_window"],
				rate(v["client_stmts_per_s"]), server, rate(v["stmts_per_s_per_process"]), rate(v["stmts_per_s_per_process_max"]),
				v["leader_stmts_per_round_mean"], v["leader_stmts_per_round_max"], v["leading_processes"],
				v["follower_stmts_per_ttl"], v["follower_stmts_per_ttl_max"], rss)
		}
		fmt.Fprintln(w)
	}

	for i := range results {
		if r := &results[i]; r.Scenario == scFloor {
			writeFloor(w, r)
		}
	}

	if len(rep.Targets) > 0 {
		fmt.Fprintln(w, "### Targets (issues 6 and 18)")
		fmt.Fprintln(w)
		fmt.Fprintln(w, "| Target | Setup | Measured | Met |")
		fmt.Fprintln(w, "|---|---|---|---|")
		for _, t := range rep.Targets {
			met := "yes"
			if !t.Met {
				met = "**no**"
			}
			fmt.Fprintf(w, "| %s | %s | %.2f %s | %s |\n", t.What, t.Setup, t.Measured, t.Unit, met)
		}
		fmt.Fprintln(w)
	}
	if len(rep.Failures) > 0 {
		fmt.Fprintln(w, "### Failed measurements")
		fmt.Fprintln(w)
		for _, f := range rep.Failures {
			fmt.Fprintf(w, "- %s\n", f)
		}
		fmt.Fprintln(w)
	}
}

// writeHandingOver writes the table of handing over on purpose, for every
// setup at the equal TTL: the graceful handover of every kind beside our
// transfers and rolling deploys (the peers cannot hand over to a chosen
// candidate: n/a).
func writeHandingOver(w io.Writer, results []Result, setupOrder []string, bySetup map[string]map[string]*Result) {
	fmt.Fprintln(w)
	fmt.Fprintln(w, "### Handing over on purpose: graceful stop, transfer, rolling deploy (equal TTL)")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| Elector | Timing | Graceful handover (ms: p50 / p99 / max) | Transfer: leaderless gap, OnDemoted return → successor's OnElected (ms) | Transfer: command → successor's OnElected (ms) | Rolling deploy: deploys where leadership changed exactly once (changes min–max) | Rolling deploy: longest leaderless gap (ms: p50 / p99 / max over deploys) | Rolling deploy: duration (s: p50 / max) |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|")
	for _, name := range setupOrder {
		m := bySetup[name]
		g := m[scGraceful]
		if g == nil || g.Defaults {
			continue
		}
		transfer, toElected, once, gap, total := "n/a", "n/a", "n/a", "n/a", "n/a"
		if isOurs(g.Kind) {
			transfer, toElected = latencyCell(m[scTransfer]), seriesCell(m[scTransfer], seriesCommandToElected)
		}
		if g.Kind == kindLeaderEtcd {
			once, gap, total = "not run", "not run", "not run"
		}
		if g.Kind == kindLease || g.Kind == kindAdvisory {
			once, gap, total = "–", "–", "–"
			if d := find(results, scRolling, g.Kind, false); d != nil && len(d.Deploys) > 0 {
				v := d.Values
				once = fmt.Sprintf("%.0f of %.0f (%.0f–%.0f)", v["exactly_once"], v["deploys"], v["changes_min"], v["changes_max"])
				gap = latencyCell(d)
				total = fmt.Sprintf("%.1f / %.1f", v["total_p50_ms"]/1000, v["total_max_ms"]/1000)
			} else if failed(results, scRolling, g.Kind) != nil {
				once = "failed"
			}
		}
		fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s | %s | %s |\n", label(g), timingCell(g.Timing, g.Kind),
			latencyCell(g), transfer, toElected, once, gap, total)
	}
}

// failed returns the failed result of scenario for kind at the equal TTL,
// or nil.
func failed(results []Result, scenario, kind string) *Result {
	for i := range results {
		r := &results[i]
		if r.Scenario == scenario && r.Kind == kind && !r.Defaults && r.Error != "" {
			return r
		}
	}
	return nil
}

// seriesCell summarizes one of r's series as latencyCell does its samples.
func seriesCell(r *Result, series string) string {
	if r == nil || len(r.SeriesMs[series]) == 0 {
		return latencyCell(r)
	}
	s := summarize(r.SeriesMs[series])
	return fmt.Sprintf("%s / %s / %s (n=%d)", fmtMs(s.P50), fmtMs(s.P99), fmtMs(s.Max), s.N)
}

func bytesCell(b float64) string {
	switch {
	case math.Abs(b) >= 1<<20:
		return fmt.Sprintf("%.1f MiB", b/(1<<20))
	case math.Abs(b) >= 1<<10:
		return fmt.Sprintf("%.1f KiB", b/(1<<10))
	default:
		return fmt.Sprintf("%.0f B", b)
	}
}

func firstWords(s string, n int) string {
	f := strings.Fields(s)
	if len(f) > n {
		f = f[:n]
	}
	return strings.Join(f, " ")
}

// thousands writes 10000 as 10,000.
func thousands(v float64) string {
	s := fmt.Sprintf("%.0f", v)
	for i := len(s) - 3; i > 0 && s[i-1] != '-'; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}

// windowCell is a scale measurement's window, with how busy the machine's
// CPUs were meanwhile.
func windowCell(v map[string]float64) string {
	if b, ok := v["machine_cpu_busy"]; ok && b >= 0 {
		return fmt.Sprintf("%.0f s (%.0f%%)", v["window_s"], 100*b)
	}
	return fmt.Sprintf("%.0f s", v["window_s"])
}

// writeFloor writes the floor's table (see measureFloor).
func writeFloor(w io.Writer, r *Result) {
	fmt.Fprintln(w, "### The floor: a handover's steps on this server, with no elector (ms: p50 / p99 / max, n trials)")
	fmt.Fprintln(w)
	if r.Error != "" {
		fmt.Fprintf(w, "Failed: %s\n\n", r.Error)
		return
	}
	fmt.Fprintln(w, "| Step | Time |")
	fmt.Fprintln(w, "|---|---|")
	for _, st := range []struct{ series, what string }{
		{seriesRoundTrip, "round trip: SELECT 1"},
		{seriesLockWake, "lock wake: the holder unlocks → the waiter, woken, runs SELECT 1, commits, and its reply is in"},
		{seriesHandover, "handover: the holder updates a row, commits, unlocks → the waiter, woken, updates a row, commits, and its reply is in"},
	} {
		if v := r.SeriesMs[st.series]; len(v) > 0 {
			sum := summarize(v)
			fmt.Fprintf(w, "| %s | %s / %s / %s (n=%d) |\n", st.what, fmtMs(sum.P50), fmtMs(sum.P99), fmtMs(sum.Max), sum.N)
		}
	}
	fmt.Fprintln(w)
}
