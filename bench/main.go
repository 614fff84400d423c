// Command bench compares leader's PostgreSQL electors (the lease and the
// advisory strategy) and leader on its etcd store with three peers, in one
// run, on one machine, one database and one etcd server: the
// table-and-heartbeat algorithm of the "leader-election" skill, client-go's
// LeaderElector on a PostgreSQL resourcelock, and etcd's
// concurrency.Election on an embedded etcd (the server our etcd store runs
// on too). It measures graceful handover, crash takeover with real
// processes (SIGKILL, and for the advisory strategy a black-holed
// connection), the statements (or etcd requests) each candidate sends at
// steady state, and the memory and goroutines of idle followers; for ours,
// a transfer to a named follower, and on PostgreSQL rolling deploys to a
// release of higher priority (issue 18); and, for the lease strategy, one
// process holding 10,000 names and 100 processes campaigning for the same
// 100 names (issue 6's scale), and one process holding 10,000 names on the
// etcd store. It prints markdown tables and writes the measurements as
// JSON.
//
// Run it from the repository root:
//
//	go -C bench run . -out bench-results.json       # full, about 42 minutes
//	go -C bench run . -quick                         # smoke run, about 5.5 minutes
//
// See README.md for the flags and what each figure means.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/rs/zerolog"
)

func main() {
	if role := os.Getenv(envRole); role != "" {
		os.Exit(childMain(role))
	}
	os.Exit(benchMain(os.Args[1:], os.Stdout, os.Stderr))
}

// bench is one run's shared machinery.
type bench struct {
	db      *database
	etcd    *etcdServer
	proxies *toxiproxy.ApiServer
	procs   *procs
	stderr  io.Writer
	start   time.Time
}

func (b *bench) logf(format string, args ...any) {
	fmt.Fprintf(b.stderr, "[%6.1fs] %s\n", time.Since(b.start).Seconds(), fmt.Sprintf(format, args...))
}

// options are the command line.
type options struct {
	quick       bool
	out         string
	databaseURL string
	ttl         time.Duration
	only        string
	followers   int
	graceful    int
	transfer    int
	crash       int
	deploys     int
	noDefaults  bool
	noIdle      bool
	noHerd      bool
	noFloor     bool
	floor       int
	idleN       int
	idleNAdv    int
	herdN       int
	childLog    string
	noScale     bool
	scaleWindow time.Duration
	scaleTTL    time.Duration
	scaleNames  int
	scaleProcs  int
	scaleProcN  int
}

func parseOptions(args []string, stderr io.Writer) (options, plan, error) {
	var o options
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.BoolVar(&o.quick, "quick", false, "smoke run: few trials, 5 followers, no peer defaults, 30s scale windows (about 5.5 minutes)")
	fs.StringVar(&o.out, "out", "bench-results.json", "write the measurements as JSON to this file (relative to the bench directory with go -C bench); empty: don't")
	fs.StringVar(&o.databaseURL, "database-url", "", "postgres:// URL of a superuser (or a role with CREATEDB and CREATEROLE) on an existing server; default: start a throwaway cluster")
	fs.DurationVar(&o.ttl, "ttl", 0, "the equal TTL at which every kind runs, whole seconds, at least 2s (etcd's minimum lease); default 2s")
	fs.StringVar(&o.only, "only", "", "run only the setups whose name matches this regular expression (names like lease@2s, lease@2s-rolling, advisory@2s-blackhole, etcd@1m0s-default, leader-etcd@2s, lease-idle, leader-etcd-idle, advisory-herd, lease-scale-10k, lease-scale-100x100, leader-etcd-scale-10k)")
	fs.IntVar(&o.followers, "followers", 0, "followers per setup (default 10; 5 with -quick)")
	fs.IntVar(&o.graceful, "graceful", 0, "graceful handover trials per setup at the equal TTL (default 100; 5 with -quick)")
	fs.IntVar(&o.crash, "crash", 0, "crash takeover trials per setup at the equal TTL (default 30, and 3x that for the advisory kill; 3 with -quick)")
	fs.IntVar(&o.transfer, "transfer", 0, "transfer trials per setup of ours (default 300; 5 with -quick)")
	fs.IntVar(&o.deploys, "deploys", 0, "rolling deploys of a 5-process group per setup of ours (default 5; 3 with -quick)")
	fs.BoolVar(&o.noDefaults, "no-defaults", false, "skip the peers at their default timing")
	fs.BoolVar(&o.noIdle, "no-idle", false, "skip the idle-cost measurement")
	fs.BoolVar(&o.noHerd, "no-herd", false, "skip the many-followers-at-release measurement")
	fs.BoolVar(&o.noFloor, "no-floor", false, "skip the floor: the server's own time for a handover's steps, with no elector (setup postgres-floor)")
	fs.IntVar(&o.floor, "floor", 0, "trials of each of the floor's steps (default 200; 20 with -quick)")
	fs.IntVar(&o.herdN, "herd", 0, "followers woken by one release in the herd measurement (default 200; 50 with -quick)")
	fs.IntVar(&o.idleN, "idle", 0, "idle followers in one process for the idle cost (default 1000; 100 with -quick)")
	fs.IntVar(&o.idleNAdv, "idle-advisory", 0, "idle followers for the advisory strategy, which opens a server connection for each (default 300; 50 with -quick)")
	fs.BoolVar(&o.noScale, "no-scale", false, "skip the scale measurements (one process holding many names, on the lease and the etcd store; many processes campaigning for the same names)")
	fs.DurationVar(&o.scaleWindow, "scale-window", 0, "the measured window of the scale measurements (default 5m for one process's names and 2m for many processes; 30s each with -quick)")
	fs.DurationVar(&o.scaleTTL, "scale-ttl", 0, "the TTL of the scale measurements (default 6s; RenewInterval is TTL/3)")
	fs.IntVar(&o.scaleNames, "scale-names", 0, "names held by one process in the scale measurements on the lease and the etcd store (default 10000)")
	fs.IntVar(&o.scaleProcs, "scale-procs", 0, "processes campaigning for the same names in the scale measurement (default 100)")
	fs.IntVar(&o.scaleProcN, "scale-proc-names", 0, "names each of those processes campaigns for (default 100)")
	fs.StringVar(&o.childLog, "child-log", "", "append the candidate processes' standard error to this file (default: a temporary file, removed unless the run fails)")
	if err := fs.Parse(args); err != nil {
		return o, plan{}, err
	}
	if fs.NArg() > 0 {
		return o, plan{}, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	p := fullPlan()
	if o.quick {
		p = quickPlan()
	}
	if o.ttl != 0 {
		if o.ttl < 2*time.Second || o.ttl%time.Second != 0 {
			return o, p, fmt.Errorf("-ttl must be whole seconds, at least 2s (the peers count whole seconds, and etcd grants no lease under 2s): %v", o.ttl)
		}
		p.equalTTL = o.ttl
	}
	for _, f := range []struct {
		v   int
		dst *int
	}{{o.followers, &p.followers}, {o.graceful, &p.graceful}, {o.crash, &p.crash}, {o.transfer, &p.transfer}, {o.deploys, &p.deploys},
		{o.idleN, &p.idleN}, {o.idleNAdv, &p.idleNAdvisory}, {o.herdN, &p.herdN}, {o.floor, &p.floorTrials},
		{o.scaleNames, &p.scaleNames}, {o.scaleProcs, &p.scaleProcs}, {o.scaleProcN, &p.scaleProcNames}} {
		if f.v < 0 {
			return o, p, fmt.Errorf("counts must not be negative")
		}
		if f.v > 0 {
			*f.dst = f.v
		}
	}
	if o.noDefaults {
		p.withDefaults = false
	}
	if o.noScale {
		p.withScale = false
	}
	if o.scaleWindow < 0 || o.scaleTTL < 0 {
		return o, p, fmt.Errorf("-scale-window and -scale-ttl must not be negative")
	}
	if o.scaleWindow > 0 {
		p.scaleNamesWindow, p.scaleProcsWindow = o.scaleWindow, o.scaleWindow
	}
	if o.scaleTTL > 0 {
		if o.scaleTTL < 3*time.Second {
			return o, p, fmt.Errorf("-scale-ttl must be at least 3s: %v", o.scaleTTL)
		}
		p.scaleTTL = o.scaleTTL
	}
	return o, p, nil
}

// report is the JSON the run writes.
type report struct {
	Mode     string    `json:"mode"`
	Started  time.Time `json:"started"`
	WallSec  float64   `json:"wall_s"`
	Machine  machine   `json:"machine"`
	Setups   []setup   `json:"setups"`
	Results  []Result  `json:"results"`
	Targets  []target  `json:"targets"`
	Failures []string  `json:"failures,omitempty"`
}

func benchMain(args []string, stdout, stderr io.Writer) int {
	o, p, err := parseOptions(args, stderr)
	if err != nil {
		if err == flag.ErrHelp {
			return 0
		}
		fmt.Fprintln(stderr, "bench:", err)
		return 2
	}
	return runBench(o, p, stdout, stderr)
}

// runBench runs plan p with the options o.
func runBench(o options, p plan, stdout, stderr io.Writer) int {
	var (
		only *regexp.Regexp
		err  error
	)
	if o.only != "" {
		if only, err = regexp.Compile(o.only); err != nil {
			fmt.Fprintln(stderr, "bench: -only:", err)
			return 2
		}
	}
	setups := p.setups()
	if only != nil {
		setups = filterSetups(setups, only)
	}

	b := &bench{stderr: stderr, start: time.Now()}
	logPath := o.childLog
	keepLog := logPath != ""
	if logPath == "" {
		f, err := os.CreateTemp("", "leaderbench-children-*.log")
		if err != nil {
			fmt.Fprintln(stderr, "bench:", err)
			return 1
		}
		f.Close()
		logPath = f.Name()
	}
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		fmt.Fprintln(stderr, "bench:", err)
		return 1
	}
	if b.procs, err = newProcs(logFile); err != nil {
		fmt.Fprintln(stderr, "bench:", err)
		return 1
	}

	// Whatever happens, no child, server or proxy outlives the run.
	failed := true
	var cleanupOnce sync.Once
	cleanup := func() {
		cleanupOnce.Do(func() {
			b.procs.killAll()
			if b.etcd != nil {
				b.etcd.close()
			}
			if b.db != nil {
				b.db.close()
			}
			logFile.Close()
			if failed || keepLog {
				fmt.Fprintf(stderr, "bench: candidate processes' log: %s\n", logPath)
			} else {
				os.Remove(logPath)
			}
		})
	}
	defer cleanup()
	defer func() {
		if v := recover(); v != nil {
			b.procs.killAll()
			panic(v)
		}
	}()
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
	defer signal.Stop(sigs)
	go func() {
		if s, ok := <-sigs; ok {
			fmt.Fprintf(stderr, "bench: %v: stopping\n", s)
			cleanup()
			os.Exit(130)
		}
	}()

	ctx := context.Background()
	mode := p.mode
	b.logf("bench (%s): %d setups; starting PostgreSQL", mode, len(setups))
	if b.db, err = openDatabase(ctx, o.databaseURL); err != nil {
		fmt.Fprintln(stderr, "bench:", err)
		return 1
	}
	needEtcd := false
	for _, s := range setups {
		needEtcd = needEtcd || usesEtcd(s.Kind)
	}
	idleKinds := []string{}
	if !o.noIdle {
		for _, k := range allKinds {
			if only == nil || only.MatchString(k+"-idle") {
				idleKinds = append(idleKinds, k)
				needEtcd = needEtcd || usesEtcd(k)
			}
		}
	}
	herdKinds := []string{}
	if !o.noHerd {
		for _, k := range []string{kindLease, kindAdvisory} {
			if only == nil || only.MatchString(k+"-herd") {
				herdKinds = append(herdKinds, k)
			}
		}
	}
	var scales []scaleRun
	if p.withScale {
		for _, sc := range p.scaleRuns() {
			if only == nil || only.MatchString(sc.name) {
				scales = append(scales, sc)
				needEtcd = needEtcd || usesEtcd(sc.kind)
			}
		}
	}
	if needEtcd {
		b.logf("starting embedded etcd")
		if b.etcd, err = startEtcd(); err != nil {
			fmt.Fprintln(stderr, "bench:", err)
			return 1
		}
	}
	b.proxies = toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())
	for slot := range max(p.followers+1, p.rollingSize) {
		if err := b.db.ensureRole(ctx, slotRole(slot)); err != nil {
			fmt.Fprintln(stderr, "bench:", err)
			return 1
		}
	}
	for _, role := range []string{idleRole, scaleRole} {
		if err := b.db.ensureRole(ctx, role); err != nil {
			fmt.Fprintln(stderr, "bench:", err)
			return 1
		}
	}

	rep := report{Mode: mode, Started: b.start, Setups: setups, Machine: describeMachine(ctx, b.db)}
	if !o.noFloor && (only == nil || only.MatchString(floorSetup)) {
		b.logf("%s: %d trials of each step", floorSetup, p.floorTrials)
		rep.Results = append(rep.Results, b.measureFloor(ctx, p.floorTrials))
	}
	for i := range setups {
		s := &setups[i]
		rep.Results = append(rep.Results, b.runSetup(ctx, s)...)
	}
	for _, kind := range idleKinds {
		n := p.idleN
		if kind == kindAdvisory {
			n = p.idleNAdvisory
		}
		b.logf("%s-idle: %d idle followers in one process", kind, n)
		rep.Results = append(rep.Results, b.measureIdle(ctx, kind, n))
	}
	for _, kind := range herdKinds {
		b.logf("%s-herd: %d followers woken by each of %d releases", kind, p.herdN, p.herdTrials)
		r := b.measureHerd(kind, p.herdN, p.herdTrials)
		if len(r.SamplesMs) > 0 {
			sum := summarize(r.SamplesMs)
			r.Summary = &sum
		}
		rep.Results = append(rep.Results, r)
	}
	for _, sc := range scales {
		rep.Results = append(rep.Results, b.measureScale(ctx, sc))
	}
	for _, r := range rep.Results {
		if r.Error != "" {
			rep.Failures = append(rep.Failures, fmt.Sprintf("%s %s: %s", r.Setup, r.Scenario, r.Error))
		}
	}
	rep.Targets = evaluateTargets(rep.Results)
	rep.WallSec = time.Since(b.start).Seconds()
	writeMarkdown(stdout, &rep)
	if o.out != "" {
		js, err := json.MarshalIndent(rep, "", "  ")
		if err == nil {
			err = os.WriteFile(o.out, append(js, '\n'), 0o644)
		}
		if err != nil {
			fmt.Fprintln(stderr, "bench: writing", o.out+":", err)
			return 1
		}
		abs, _ := filepath.Abs(o.out)
		b.logf("wrote %s", abs)
	}
	if len(rep.Failures) > 0 {
		fmt.Fprintf(stderr, "bench: %d measurements failed:\n  %s\n", len(rep.Failures), strings.Join(rep.Failures, "\n  "))
		return 1
	}
	failed = false
	return 0
}

func filterSetups(setups []setup, only *regexp.Regexp) []setup {
	var out []setup
	for _, s := range setups {
		if only.MatchString(s.Name) {
			out = append(out, s)
		}
	}
	return out
}

// dbSafe turns a setup name into part of a database name.
func dbSafe(s string) string {
	return strings.Map(func(r rune) rune {
		if (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9') {
			return r
		}
		return '_'
	}, strings.ToLower(s))
}

// runSetup runs one setup's scenarios on one group of candidate processes.
func (b *bench) runSetup(ctx context.Context, s *setup) []Result {
	start := time.Now()
	b.logf("%s (%s, %d followers)", s.Name, s.Timing, s.Followers)
	var results []Result
	newResult := func(sc string) Result {
		return Result{Scenario: sc, Setup: s.Name, Kind: s.Kind, Timing: s.Timing, Defaults: s.Defaults, Followers: s.Followers}
	}
	failAll := func(err error) []Result {
		b.logf("%s: %v", s.Name, err)
		for _, sc := range s.Scenarios {
			r := newResult(sc)
			r.Error = err.Error()
			results = append(results, r)
		}
		return results
	}
	dbname := "lb_" + dbSafe(s.Name)
	if !usesEtcd(s.Kind) {
		roles := make([]string, s.Followers+1)
		for i := range roles {
			roles[i] = slotRole(i)
		}
		if err := b.db.createDatabase(ctx, dbname, s.Kind, roles); err != nil {
			return failAll(err)
		}
		defer b.db.dropDatabase(context.Background(), dbname)
	}
	g, err := b.startGroup(s, dbname, s.Followers+1)
	if err != nil {
		return failAll(err)
	}
	defer g.close()
	for _, name := range s.Scenarios {
		sc := groupScenarios[name]
		r := newResult(name)
		t := time.Now()
		if err := sc.run(g, &r); err != nil {
			r.Error = err.Error()
			b.logf("%s %s: %v", s.Name, name, err)
		}
		r.WallSec = time.Since(t).Seconds()
		if len(r.SamplesMs) > 0 {
			sum := summarize(r.SamplesMs)
			r.Summary = &sum
			b.logf("  %s %s: p50 %.1f ms, p99 %.1f ms, max %.1f ms (%d samples)", s.Name, name, sum.P50, sum.P99, sum.Max, len(r.SamplesMs))
		}
		results = append(results, r)
	}
	b.logf("%s done in %.0fs", s.Name, time.Since(start).Seconds())
	return results
}
