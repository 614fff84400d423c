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
	lastReason                                 string // of the last election (ours)
	counts                                     counts
	exited                                     bool

	// Ours: its priority; the times its current campaign was enlisted as
	// a candidate (0 again when it stops or is demoted: a leader's
	// release removes its entry, and a transfer to it would be refused
	// until it enlists again); its losses; when it read the last transfer
	// command; the outcomes of its transfers, and the last one.
	priority          int
	enlisted, demoted int
	lastTransferCmdT  int64
	transfers         int
	lastTransfer      event
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
	// While recording, every election and loss goes into timeline (the
	// rolling deploy's account of leadership).
	recording bool
	timeline  []leadershipEvent
}

// leadershipEvent is an election (elected) or a loss, at t on
// CLOCK_MONOTONIC: a loss's t is when OnDemoted ran (or, for a leader that
// stopped or exited without one, when the stop was written, or read).
type leadershipEvent struct {
	m       *member
	elected bool
	t       int64
	reason  string
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

// spawn starts a candidate process in slot, at priority 0.
func (g *group) spawn(slot int) (*member, error) {
	m, err := g.launch(slot, 0)
	if err != nil {
		return nil, err
	}
	g.members[slot] = m
	return m, nil
}

// launch starts a candidate process for slot (with the slot's role) at
// priority, and leaves the slot as it is.
func (g *group) launch(slot, priority int) (*member, error) {
	g.gen++
	m := &member{slot: slot, id: fmt.Sprintf("c%d.%d", slot, g.gen), role: slotRole(slot), priority: priority}
	hostport := ""
	if g.s.Proxy {
		m.proxy = toxiproxy.NewProxy(g.b.proxies, fmt.Sprintf("%s-%s", g.s.Name, m.id), "127.0.0.1:0", g.b.db.addr())
		if err := m.proxy.Start(); err != nil {
			return nil, fmt.Errorf("starting the proxy of %s: %w", m.id, err)
		}
		hostport = m.proxy.Listen
	}
	spec := childSpec{Kind: g.s.Kind, Timing: g.s.Timing, Name: electionName, ID: m.id,
		Priority: priority, HandOverOnStop: g.s.HandOverOnStop}
	if g.s.Kind == kindSkill {
		// The skill's candidates poll on a fixed ticker from their start:
		// started together, they would all poll at the same moments, which
		// instances started at different times do not.
		spec.StartDelay = duration(rand.N(g.s.Timing.Renew.D()))
	}
	if usesEtcd(g.s.Kind) {
		spec.Etcd, spec.EtcdPrefix = g.b.etcd.url, leaderEtcdPrefix(g.s.Name)
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
	return m, nil
}

// apply records one event.
func (g *group) apply(me memberEvent) {
	m, ev := me.m, me.ev
	switch ev.Ev {
	case "ready":
		m.ready++
	case "enlisted":
		m.enlisted++
	case "elected":
		m.elected++
		m.leader = true
		m.lastElectedT, m.lastTerm, m.lastReason = ev.T, ev.Term, ev.Reason
		g.record(m, true, ev.T, ev.Reason)
	case "demoted":
		m.demoted++
		m.enlisted = 0
		m.leader = false
		m.lastDemotedT = ev.T
		g.record(m, false, ev.T, "")
	case "stopping":
		m.stopping++
		m.enlisted = 0
		m.lastStoppingT = ev.T
	case "stopped":
		m.stopped++
		if m.leader {
			m.leader = false
			m.lastDemotedT = ev.T
			g.record(m, false, ev.T, "")
		}
	case "transfer":
		m.lastTransferCmdT = ev.T
	case "transferred":
		m.transfers++
		m.lastTransfer = ev
	case "counts":
		m.countsN++
		if ev.Counts != nil {
			m.counts = *ev.Counts
		}
	case "exit":
		m.exited = true
		if m.leader {
			g.record(m, false, monoNow(), "")
		}
		m.leader = false
	case "error":
		msg := fmt.Sprintf("%s %s: %s", g.s.Name, m.id, ev.Msg)
		g.errors = append(g.errors, msg)
		g.b.logf("child error: %s", msg)
	}
}

// record adds an election or a loss to the timeline, while recording.
func (g *group) record(m *member, elected bool, t int64, reason string) {
	if g.recording {
		g.timeline = append(g.timeline, leadershipEvent{m: m, elected: elected, t: t, reason: reason})
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

// surge replaces old the way a rolling deploy with surge does: a new
// process for old's slot, at priority, starts beside it; once the new one
// campaigns and is enlisted as a candidate (so a leader may pick it), old
// is told to exit (which, with the setup's HandOverOnStop, hands over to
// the best other candidate if it leads, as "leader run" does at SIGTERM)
// and exits; then the new process takes the slot. On an error both stay
// in the group, so that close stops them.
func (g *group) surge(old *member, priority int) error {
	n, err := g.launch(old.slot, priority)
	if err != nil {
		return err
	}
	g.members = append(g.members, n)
	if err := g.waitUntil(time.Minute, n.id+" campaigning", func() bool { return n.ready > 0 || n.exited }); err != nil {
		return err
	}
	// A follower of ours enlists at its start, and again every TTL.
	err = g.waitUntil(2*g.s.Timing.TTL.D()+5*time.Second, n.id+" enlisted as a candidate", func() bool { return n.enlisted > 0 || n.exited })
	switch {
	case err != nil:
		return fmt.Errorf("%w: does the store implement leader.Transferer?", err)
	case n.exited:
		return fmt.Errorf("%s exited", n.id)
	}
	old.p.send(cmdExit)
	if err := g.waitUntil(2*g.s.Timing.TTL.D()+30*time.Second, old.id+" exiting", func() bool { return old.exited }); err != nil {
		return err
	}
	if old.proxy != nil {
		old.proxy.Stop()
	}
	g.members = g.members[:len(g.members)-1]
	g.members[old.slot] = n
	return nil
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
