package main

import (
	"encoding/json"
	"fmt"
	"time"
)

// The elector kinds the benchmark runs.
const (
	kindLease    = "lease"     // ours, postgres.NewLeaseStore
	kindAdvisory = "advisory"  // ours, postgres.NewAdvisoryStore
	kindSkill    = "skill"     // the "leader-election" skill's table and heartbeat
	kindClientGo = "client-go" // k8s.io/client-go/tools/leaderelection on a PostgreSQL resourcelock
	kindEtcd     = "etcd"      // go.etcd.io/etcd/client/v3/concurrency on an embedded etcd
	// kindLeaderEtcd is ours on etcd: leader.New on etcd.New, on the same
	// embedded etcd as kindEtcd.
	kindLeaderEtcd = "leader-etcd"
)

var allKinds = []string{kindLease, kindAdvisory, kindSkill, kindClientGo, kindEtcd, kindLeaderEtcd}

// isOurs tells whether kind is leader's Elector (on any store): it can
// transfer leadership to a named candidate.
func isOurs(kind string) bool {
	return kind == kindLease || kind == kindAdvisory || kind == kindLeaderEtcd
}

// etcdLeaseSeconds is the TTL of the etcd lease on which our etcd store
// keeps a name held with ttl: whole seconds, rounded up, at least the
// embedded server's minimum (2s).
func etcdLeaseSeconds(ttl time.Duration) int64 {
	return max(int64((ttl+time.Second-1)/time.Second), 2)
}

// usesEtcd tells whether kind campaigns on the embedded etcd (and not on
// PostgreSQL).
func usesEtcd(kind string) bool { return kind == kindEtcd || kind == kindLeaderEtcd }

// duration is a time.Duration that reads and writes as "1.5s" in JSON.
type duration time.Duration

func (d duration) MarshalJSON() ([]byte, error) { return json.Marshal(time.Duration(d).String()) }

func (d *duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return err
	}
	v, err := time.ParseDuration(s)
	*d = duration(v)
	return err
}

func (d duration) D() time.Duration { return time.Duration(d) }

// timing is an elector's timing, in the terms of each kind:
//
//	kind       TTL                           Renew                          RenewDeadline
//	lease      Config.TTL                    Config.RenewInterval
//	advisory   Config.TTL                    Config.RenewInterval
//	skill      heartbeatTimeoutSeconds       heartbeatInterval (followers poll at it too)
//	client-go  LeaseDuration                 RetryPeriod (renew and retry)  RenewDeadline
//	etcd       session TTL (whole seconds)   TTL/3, the client's keep-alive (not settable)
//
// leader-etcd is timed as lease and advisory are (Config.TTL and
// Config.RenewInterval); its store keeps each name on an etcd lease of
// ceil(TTL) seconds, at least the server's minimum (2s at etcd's default
// raft timing).
type timing struct {
	TTL           duration `json:"ttl"`
	Renew         duration `json:"renew"`
	RenewDeadline duration `json:"renew_deadline,omitempty"`
}

func (t timing) String() string {
	s := fmt.Sprintf("TTL %s, renew %s", shortDur(t.TTL.D()), shortDur(t.Renew.D()))
	if t.RenewDeadline != 0 {
		s += fmt.Sprintf(", deadline %s", shortDur(t.RenewDeadline.D()))
	}
	return s
}

// timingAt returns kind's timing for a TTL of ttl, scaled as each kind's
// defaults are (ttl must be whole seconds for skill, client-go and etcd).
func timingAt(kind string, ttl time.Duration) timing {
	switch kind {
	case kindClientGo: // defaults 15s / 10s / 2s
		return timing{TTL: duration(ttl), Renew: duration(ttl * 2 / 15), RenewDeadline: duration(ttl * 10 / 15)}
	default: // ours: RenewInterval TTL/3; skill: the rule interval < timeout/3 at its limit; etcd: keep-alive TTL/3
		return timing{TTL: duration(ttl), Renew: duration(ttl / 3)}
	}
}

// defaultTiming returns kind's documented default timing.
func defaultTiming(kind string) timing {
	switch kind {
	case kindSkill:
		return timing{TTL: duration(30 * time.Second), Renew: duration(10 * time.Second)}
	case kindClientGo:
		return timing{TTL: duration(15 * time.Second), Renew: duration(2 * time.Second), RenewDeadline: duration(10 * time.Second)}
	case kindEtcd:
		return timing{TTL: duration(60 * time.Second), Renew: duration(20 * time.Second)}
	default: // ours: DefaultTTL 15s, RenewInterval TTL/3
		return timing{TTL: duration(15 * time.Second), Renew: duration(5 * time.Second)}
	}
}

// setup is one elector kind at one timing, run as a group of candidate
// processes, with the scenarios that apply to it.
type setup struct {
	Name     string `json:"name"` // unique, e.g. "lease@2s"
	Kind     string `json:"kind"`
	Timing   timing `json:"timing"`
	Defaults bool   `json:"defaults"` // the kind's documented defaults (else the equal TTL)
	// Proxy puts an in-process TCP proxy between each candidate and the
	// database, for black-holing a leader's connections.
	Proxy bool `json:"proxy,omitempty"`
	// HandOverOnStop sets ours' Config.HandOverOnStop: a leader told to
	// exit hands over to the best other candidate, as "leader run" does
	// at SIGTERM (the rolling deploy).
	HandOverOnStop bool `json:"hand_over_on_stop,omitempty"`

	Followers      int      `json:"followers"`
	GracefulTrials int      `json:"graceful_trials"`
	TransferTrials int      `json:"transfer_trials,omitempty"`
	CrashTrials    int      `json:"crash_trials"`
	Deploys        int      `json:"deploys,omitempty"` // rolling deploys
	LoadWindow     duration `json:"load_window"`
	Scenarios      []string `json:"scenarios"`
	Note           string   `json:"note,omitempty"`
}

// plan is what a run measures.
type plan struct {
	mode            string
	equalTTL        time.Duration
	followers       int
	graceful, crash int // trials at the equal TTL
	transfer        int // transfer trials (ours)
	// deploys is how many rolling deploys (ours) replace a group of
	// rollingSize processes.
	deploys, rollingSize int
	// defaultsGraceful and defaultsCrash are the trials at the peers'
	// defaults, where one crash trial takes a whole default TTL (up to 60s).
	defaultsGraceful int
	defaultsCrash    map[string]int
	loadWindow       func(timing) time.Duration
	withDefaults     bool
	idleN            int
	idleNAdvisory    int
	herdN            int // followers woken at once by a release
	herdTrials       int
	floorTrials      int // trials of each of the floor's steps (see measureFloor)
	// The scale measurements (lease strategy only): one process holding
	// scaleNames names, and scaleProcs processes campaigning for the same
	// scaleProcNames names, each at scaleTTL, over their windows.
	withScale        bool
	scaleTTL         time.Duration
	scaleNames       int
	scaleNamesWindow time.Duration
	scaleProcs       int
	scaleProcNames   int
	scaleProcsWindow time.Duration
}

func quickPlan() plan {
	return plan{
		mode:     "quick",
		equalTTL: 2 * time.Second, followers: 5, graceful: 5, crash: 2,
		transfer: 5, deploys: 3, rollingSize: 5,
		loadWindow: func(t timing) time.Duration { return 2 * t.TTL.D() },
		idleN:      100, idleNAdvisory: 50,
		herdN: 50, herdTrials: 3, floorTrials: 20,
		withScale: true, scaleTTL: 6 * time.Second,
		scaleNames: 10_000, scaleNamesWindow: 30 * time.Second,
		scaleProcs: 100, scaleProcNames: 100, scaleProcsWindow: 30 * time.Second,
	}
}

func fullPlan() plan {
	return plan{
		mode:     "full",
		equalTTL: 2 * time.Second, followers: 10, graceful: 100, crash: 30,
		transfer: 300, deploys: 5, rollingSize: 5,
		defaultsGraceful: 20,
		defaultsCrash:    map[string]int{kindSkill: 2, kindClientGo: 3, kindEtcd: 2},
		loadWindow: func(t timing) time.Duration {
			// At least 10 renewals by the leader and 2 TTLs, at most 45s.
			return min(max(10*t.Renew.D(), 2*t.TTL.D(), 20*time.Second), 45*time.Second)
		},
		withDefaults: true,
		idleN:        1000, idleNAdvisory: 300,
		herdN: 200, herdTrials: 100, floorTrials: 200,
		withScale: true, scaleTTL: 6 * time.Second,
		scaleNames: 10_000, scaleNamesWindow: 5 * time.Minute,
		scaleProcs: 100, scaleProcNames: 100, scaleProcsWindow: 2 * time.Minute,
	}
}

// Scenario names.
const (
	scLoad      = "steady-load"
	scGraceful  = "graceful-handover"
	scCrash     = "crash-takeover"
	scBlackHole = "blackhole-takeover"
	scIdle      = "idle-cost"
)

// setups returns the setups of p, in the order they run.
func (p plan) setups() []setup {
	var out []setup
	add := func(kind string, t timing, defaults bool, graceful, crash int, scenarios ...string) {
		name := fmt.Sprintf("%s@%v", kind, t.TTL.D())
		if defaults {
			name += "-default"
		}
		out = append(out, setup{
			Name: name, Kind: kind, Timing: t, Defaults: defaults, Followers: p.followers,
			GracefulTrials: graceful, CrashTrials: crash, LoadWindow: duration(p.loadWindow(t)), Scenarios: scenarios,
		})
	}
	for _, kind := range allKinds {
		if !isOurs(kind) {
			add(kind, timingAt(kind, p.equalTTL), false, p.graceful, p.crash, scLoad, scGraceful, scCrash)
			continue
		}
		if kind == kindLeaderEtcd {
			// Ours on etcd, beside etcd's own election: no black hole
			// (the proxies are PostgreSQL's) and no rolling deploy.
			add(kind, timingAt(kind, p.equalTTL), false, p.graceful, p.crash, scLoad, scGraceful, scTransfer, scCrash)
			out[len(out)-1].TransferTrials = p.transfer
			continue
		}
		add(kind, timingAt(kind, p.equalTTL), false, p.graceful, p.crash, scLoad, scGraceful, scTransfer, scCrash)
		out[len(out)-1].TransferTrials = p.transfer
		if kind == kindAdvisory {
			// The advisory kill takes milliseconds: many more trials fit,
			// and a p99 of fewer than 200 is little more than the maximum.
			out[len(out)-1].CrashTrials = 2 * p.graceful
			add(kind, timingAt(kind, p.equalTTL), false, 0, p.crash, scBlackHole)
			out[len(out)-1].Name += "-blackhole"
			out[len(out)-1].Proxy = true
		}
		add(kind, timingAt(kind, p.equalTTL), false, 0, 0, scRolling)
		out[len(out)-1].Name += "-rolling"
		out[len(out)-1].Followers = p.rollingSize - 1
		out[len(out)-1].Deploys = p.deploys
		out[len(out)-1].HandOverOnStop = true
	}
	if p.withDefaults {
		for _, kind := range []string{kindSkill, kindClientGo, kindEtcd} {
			add(kind, defaultTiming(kind), true, p.defaultsGraceful, p.defaultsCrash[kind], scLoad, scGraceful, scCrash)
		}
	}
	return out
}
