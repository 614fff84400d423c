package main

import (
	"fmt"
	"slices"
	"time"
)

// The transfer scenario (ours only: the peers cannot hand leadership to a
// chosen candidate): the leader is told to hand over to a named follower,
// and the figure is how long nobody led.

const (
	scTransfer = "transfer"
	// seriesCommandToElected is the transfer's second figure, in
	// Result.SeriesMs: from the command to the successor's OnElected.
	seriesCommandToElected = "command_to_elected"
)

// measureTransfer: after a random wait (up to a renew interval, so that
// the command falls anywhere between two renewals, and sometimes while
// one is in flight), the leader process is told to hand over to a named
// follower, a different one each trial (the followers in turn, by slot);
// it calls Elector.Transfer. The figure is the leaderless gap: from the
// old leader's OnDemoted returning to the successor's OnElected, both on
// CLOCK_MONOTONIC. Beside it, in SeriesMs, the time from the moment the
// leader process read the command to the successor's OnElected (which
// adds listing the candidates and stepping down). A trial fails unless
// Transfer returned without error, and the first process elected after
// the command is the named one, with the old term + 1 and the reason
// "transfer". The old leader campaigns on as a follower.
func measureTransfer(g *group, r *Result) error {
	var toElected []float64
	last := -1 // the slot of the last trial's successor
	err := trialLoop(g, r, g.s.TransferTrials, func() (float64, error) {
		l, err := g.waitLeader()
		if err != nil {
			return 0, err
		}
		// A follower that led is enlisted again only by its first attempt
		// after its release (see the event "enlisted"): wait for one.
		var to *member
		if err := g.waitUntil(2*g.s.Timing.TTL.D()+5*time.Second, "follower enlisted as a candidate", func() bool {
			to = g.nextFollower(l, last)
			return to != nil
		}); err != nil {
			return 0, err
		}
		last = to.slot
		g.phase()
		term, demoted, transfers := l.lastTerm, l.demoted, l.transfers
		l.p.send(cmdTransfer + " " + to.id)
		if err := g.waitUntil(g.takeoverTimeout(), l.id+" handing over to "+to.id, func() bool { return l.transfers > transfers }); err != nil {
			return 0, err
		}
		if msg := l.lastTransfer.Msg; msg != "" {
			return 0, fmt.Errorf("%s: Transfer to %s: %s", l.id, to.id, msg)
		}
		cmdT := l.lastTransferCmdT
		var next *member
		// Transfer returns once the successor holds the lease; the two
		// processes' events may still be on their way.
		err = g.waitUntil(10*time.Second, l.id+"'s demotion and the successor's election", func() bool {
			next = g.electedAfter(cmdT, l)
			return l.demoted > demoted && next != nil
		})
		switch {
		case err != nil:
			return 0, err
		case next != to:
			return 0, fmt.Errorf("%s was elected after the command, not %s", next.id, to.id)
		case next.lastTerm != term+1 || l.lastTransfer.Term != next.lastTerm || l.lastTransfer.Holder != to.id:
			return 0, fmt.Errorf("%s was elected with term %d after term %d (Transfer returned %s's lease with term %d)",
				next.id, next.lastTerm, term, l.lastTransfer.Holder, l.lastTransfer.Term)
		case next.lastReason != "transfer":
			return 0, fmt.Errorf("%s was elected with reason %q, not \"transfer\"", next.id, next.lastReason)
		}
		toElected = append(toElected, ms(next.lastElectedT-cmdT))
		return ms(next.lastElectedT - l.lastDemotedT), nil
	})
	if len(toElected) > 0 {
		r.SeriesMs = map[string][]float64{seriesCommandToElected: toElected}
	}
	return err
}

// nextFollower returns the live follower enlisted as a candidate whose slot
// comes first after slot last (in turn, wrapping round), other than
// leader; nil if there is none.
func (g *group) nextFollower(leader *member, last int) *member {
	var cands []*member
	for _, m := range g.live() {
		if m != leader && m.enlisted > 0 {
			cands = append(cands, m)
		}
	}
	if len(cands) == 0 {
		return nil
	}
	slices.SortFunc(cands, func(a, b *member) int { return a.slot - b.slot })
	for _, m := range cands {
		if m.slot > last {
			return m
		}
	}
	return cands[0]
}
