package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"

	"github.com/leaderelect/leader/internal/monotime"
)

// electionName is the one election every group campaigns for (each setup
// has a database, or for etcd a key prefix, of its own).
const electionName = "bench"

// member is the candidate process in one slot of a group, and what its
// events said so far.
type member struct {
	slot  int
	id    string
	role  string // its database role
	p     *proc
	proxy *toxiproxy.Proxy // with setup.Proxy

	ready, elected, stopping, stopped, countsN int
	leader                                     bool
	lastElectedT, lastStoppingT, lastDemotedT  int64
	lastTerm                                   uint64
	counts                                     counts
	exited                                     bool
}

type memberEvent struct {
	m  *member
	ev event
}

// group is the candidate processes of one setup: a leader and its
// followers, each in a slot that a replacement takes when one is killed.
type group struct {
	b       *bench
	s       *setup
	dbname  string
	members []*member
	events  chan memberEvent
	gen     int
	errors  []string
}

// slotRole is the database role of a slot's candidates.
func slotRole(slot int) string { return fmt.Sprintf("lb_c%d", slot) }

func (b *bench) startGroup(s *setup, dbname string, size int) (*group, error) {
	g := &group{b: b, s: s, dbname: dbname, members: make([]*member, size), events: make(chan memberEvent, 4096)}
	for slot := range size {
		if _, err := g.spawn(slot); err != nil {
			g.close()
			return nil, err
		}
	}
	err := g.waitUntil(time.Minute, "every candidate campaigning and a leader elected", func() bool {
		return g.allReady() && g.leader() != nil
	})
	if err != nil {
		g.close()
		return nil, err
	}
	return g, nil
}

// spawn starts a candidate process in slot.
func (g *group) spawn(slot int) (*member, error) {
	g.gen++
	m := &member{slot: slot, id: fmt.Sprintf("c%d.%d", slot, g.gen), role: slotRole(slot)}
	hostport := ""
	if g.s.Proxy {
		m.proxy = toxiproxy.NewProxy(g.b.proxies, fmt.Sprintf("%s-%s", g.s.Name, m.id), "127.0.0.1:0", g.b.db.addr())
		if err := m.proxy.Start(); err != nil {
			return nil, fmt.Errorf("starting the proxy of %s: %w", m.id, err)
		}
		hostport = m.proxy.Listen
	}
	spec := childSpec{Kind: g.s.Kind, Timing: g.s.Timing, Name: electionName, ID: m.id}
	if g.s.Kind == kindSkill {
		// The skill's candidates poll on a fixed ticker from their start:
		// started together, they would all poll at the same moments, which
		// instances started at different times do not.
		spec.StartDelay = duration(rand.N(g.s.Timing.Renew.D()))
	}
	if g.s.Kind == kindEtcd {
		spec.Etcd = g.b.etcd.url
	} else {
		spec.ConnString = g.b.db.connString(g.dbname, m.role, hostport)
	}
	p, events, err := g.b.procs.start(roleCandidate, spec)
	if err != nil {
		if m.proxy != nil {
			m.proxy.Stop()
		}
		return nil, err
	}
	m.p = p
	go func() {
		for ev := range events {
			g.events <- memberEvent{m, ev}
		}
		g.events <- memberEvent{m, event{Ev: "exit"}}
	}()
	g.members[slot] = m
	return m, nil
}

// apply records one event.
func (g *group) apply(me memberEvent) {
	m, ev := me.m, me.ev
	switch ev.Ev {
	case "ready":
		m.ready++
	case "elected":
		m.elected++
		m.leader = true
		m.lastElectedT, m.lastTerm = ev.T, ev.Term
	case "demoted":
		m.leader = false
		m.lastDemotedT = ev.T
	case "stopping":
		m.stopping++
		m.lastStoppingT = ev.T
	case "stopped":
		m.stopped++
		if m.leader {
			m.leader = false
			m.lastDemotedT = ev.T
		}
	case "counts":
		m.countsN++
		if ev.Counts != nil {
			m.counts = *ev.Counts
		}
	case "exit":
		m.exited = true
		m.leader = false
	case "error":
		msg := fmt.Sprintf("%s %s: %s", g.s.Name, m.id, ev.Msg)
		g.errors = append(g.errors, msg)
		g.b.logf("child error: %s", msg)
	}
}

// waitUntil applies events until cond holds, or fails after timeout.
func (g *group) waitUntil(timeout time.Duration, what string, cond func() bool) error {
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	for {
		// Apply what has arrived before judging.
		for drained := false; !drained; {
			select {
			case me := <-g.events:
				g.apply(me)
			default:
				drained = true
			}
		}
		if cond() {
			return nil
		}
		select {
		case me := <-g.events:
			g.apply(me)
		case <-timer.C:
			return fmt.Errorf("%s: no %s within %v (%s)", g.s.Name, what, timeout, g.describe())
		}
	}
}

// sleep waits for d, applying events meanwhile.
func (g *group) sleep(d time.Duration) {
	timer := time.NewTimer(d)
	defer timer.Stop()
	for {
		select {
		case me := <-g.events:
			g.apply(me)
		case <-timer.C:
			return
		}
	}
}

func (g *group) describe() string {
	var parts []string
	for _, m := range g.members {
		if m == nil {
			continue
		}
		state := "follower"
		switch {
		case m.exited:
			state = "exited"
		case m.leader:
			state = "leader"
		case m.ready == 0:
			state = "starting"
		}
		parts = append(parts, m.id+":"+state)
	}
	if len(g.errors) > 0 {
		parts = append(parts, "errors: "+strings.Join(g.errors, "; "))
	}
	return strings.Join(parts, " ")
}

func (g *group) live() []*member {
	var out []*member
	for _, m := range g.members {
		if m != nil && !m.exited {
			out = append(out, m)
		}
	}
	return out
}

func (g *group) allReady() bool {
	for _, m := range g.members {
		if m == nil || m.exited || m.ready == 0 {
			return false
		}
	}
	return true
}

// leader returns the live member that believes it leads, the latest
// elected if several do (a black-holed leader may not know yet).
func (g *group) leader() *member {
	var l *member
	for _, m := range g.live() {
		if m.leader && (l == nil || m.lastElectedT > l.lastElectedT) {
			l = m
		}
	}
	return l
}

// electedAfter returns the first live member other than not elected after
// t (whether or not it still leads), or nil.
func (g *group) electedAfter(t int64, not *member) *member {
	var first *member
	for _, m := range g.live() {
		if m != not && m.lastElectedT > t && (first == nil || m.lastElectedT < first.lastElectedT) {
			first = m
		}
	}
	return first
}

func (g *group) waitLeader() (*member, error) {
	var l *member
	err := g.waitUntil(2*g.s.Timing.TTL.D()+30*time.Second, "leader with every candidate campaigning", func() bool {
		l = g.leader()
		return l != nil && g.allReady()
	})
	return l, err
}

// phase sleeps for a random part of the renew interval, so that faults
// fall anywhere between two renewals.
func (g *group) phase() {
	g.sleep(rand.N(g.s.Timing.Renew.D()) + time.Millisecond)
}

// shortPhase sleeps for a random part of the renew interval, at most a
// second: before a graceful stop, where the leader's renewals matter less
// than the followers' own rhythm, which is theirs whatever the wait.
func (g *group) shortPhase() {
	g.sleep(rand.N(min(g.s.Timing.Renew.D(), time.Second)) + time.Millisecond)
}

// takeoverTimeout bounds the wait for a successor.
func (g *group) takeoverTimeout() time.Duration {
	return 2*g.s.Timing.TTL.D() + 2*g.s.Timing.Renew.D() + 15*time.Second
}

// replace kills m if it still runs, waits for it to exit, and starts a
// replacement in its slot that has made its first attempt.
func (g *group) replace(m *member) error {
	m.p.kill()
	if err := g.waitUntil(30*time.Second, m.id+" exiting", func() bool { return m.exited }); err != nil {
		return err
	}
	if m.proxy != nil {
		m.proxy.Stop()
	}
	n, err := g.spawn(m.slot)
	if err != nil {
		return err
	}
	return g.waitUntil(time.Minute, n.id+" campaigning", func() bool { return n.ready > 0 || n.exited })
}

// collectCounts asks every live member for its counts and waits for them.
func (g *group) collectCounts() error {
	want := map[*member]int{}
	for _, m := range g.live() {
		want[m] = m.countsN + 1
		m.p.send(cmdCounts)
	}
	return g.waitUntil(30*time.Second, "statement counts", func() bool {
		for m, n := range want {
			if m.countsN < n && !m.exited {
				return false
			}
		}
		return true
	})
}

// blackHole makes m's proxy drop every byte both ways, never closing the
// connections: toxiproxy's timeout toxic with timeout 0 on both streams.
func (g *group) blackHole(m *member) error {
	for _, stream := range []string{"upstream", "downstream"} {
		js, _ := json.Marshal(map[string]any{
			"name": "blackhole_" + stream, "type": "timeout", "stream": stream, "toxicity": 1,
			"attributes": map[string]any{"timeout": 0},
		})
		if _, err := m.proxy.Toxics.AddToxicJson(bytes.NewReader(js)); err != nil {
			return fmt.Errorf("black-holing %s: %w", m.id, err)
		}
	}
	return nil
}

// close stops every member: "exit", then SIGKILL after a grace period.
func (g *group) close() {
	done := make(chan struct{})
	live := g.live()
	for _, m := range live {
		go func() {
			m.p.stop(15 * time.Second)
			done <- struct{}{}
		}()
	}
	for range live {
		<-done
	}
	for _, m := range g.members {
		if m != nil && m.proxy != nil {
			m.proxy.Stop()
		}
	}
	// Drain the exit events so that the forwarding goroutines end.
	_ = g.waitUntil(5*time.Second, "exits", func() bool {
		return !slices.ContainsFunc(g.members, func(m *member) bool { return m != nil && !m.exited })
	})
}

func monoNow() int64 {
	t, err := monotime.Now()
	if err != nil {
		panic(err)
	}
	return t
}
