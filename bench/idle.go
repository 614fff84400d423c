package main

import (
	"context"
	"fmt"
	"time"
)

// idleRole is the database role of the idle-cost process.
const idleRole = "lb_idle"

// measureIdle measures what an idle follower costs: one process runs n
// followers of an election whose leader is another process, and reports
// the growth of its Go heap in use and of its goroutines over the same
// process with the shared pool, store or client and no elector, divided by
// n. The bench counts the server connections the process holds meanwhile.
// Each kind runs at its default timing.
func (b *bench) measureIdle(ctx context.Context, kind string, n int) (r Result) {
	start := time.Now()
	t := defaultTiming(kind)
	s := &setup{Name: fmt.Sprintf("%s-idle", kind), Kind: kind, Timing: t, Defaults: true}
	r = Result{Scenario: scIdle, Setup: s.Name, Kind: kind, Timing: t, Defaults: true, Trials: 1}
	defer func() { r.WallSec = time.Since(start).Seconds() }()
	fail := func(err error) Result {
		r.Error = err.Error()
		b.logf("%s: %v", s.Name, err)
		return r
	}
	dbname := "lb_idle_" + dbSafe(kind)
	if !usesEtcd(kind) {
		if err := b.db.createDatabase(ctx, dbname, kind, []string{slotRole(0), idleRole}); err != nil {
			return fail(err)
		}
		defer b.db.dropDatabase(context.Background(), dbname)
	}
	g, err := b.startGroup(s, dbname, 1) // the leader
	if err != nil {
		return fail(err)
	}
	defer g.close()

	spec := childSpec{Kind: kind, Timing: t, Name: electionName, ID: "idle", IdleN: n}
	if usesEtcd(kind) {
		spec.Etcd, spec.EtcdPrefix = b.etcd.url, leaderEtcdPrefix(s.Name)
	} else {
		spec.ConnString = b.db.connString(dbname, idleRole, "")
	}
	p, events, err := b.procs.start(roleIdle, spec)
	if err != nil {
		return fail(err)
	}
	defer p.stop(15 * time.Second)
	timeout := time.After(5 * time.Minute)
	for {
		select {
		case ev, ok := <-events:
			if !ok {
				return fail(fmt.Errorf("the idle process exited without a report"))
			}
			switch ev.Ev {
			case "error":
				return fail(fmt.Errorf("idle process: %s", ev.Msg))
			case "idle":
				rep := ev.Idle
				r.Followers = rep.N
				r.Values = map[string]float64{
					"heap_inuse_bytes_per_elector": rep.HeapInuseBytes,
					"heap_alloc_bytes_per_elector": rep.HeapAllocBytes,
					"goroutines_per_elector":       rep.Goroutines,
					"ready_after_ms":               rep.ReadyAfterMillis,
				}
				if !usesEtcd(kind) {
					sc, err := b.db.serverCounts(ctx, dbname)
					if err != nil {
						return fail(err)
					}
					r.Values["server_connections_per_elector"] = float64(sc.Connections[idleRole]) / float64(rep.N)
				} else if kind == kindEtcd {
					r.Notes = append(r.Notes, "etcd: every session shares the process's one client connection")
				} else {
					r.Notes = append(r.Notes, "etcd store: every Elector shares the process's one client connection and Store")
				}
				if kind == kindAdvisory {
					r.Notes = append(r.Notes, "advisory: each candidate campaigns on a connection of its own")
				}
				return r
			}
		case <-timeout:
			return fail(fmt.Errorf("no report from the idle process in 5 minutes"))
		}
	}
}
