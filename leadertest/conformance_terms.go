package leadertest

import (
	"testing"
	"time"

	"github.com/leaderelect/leader"
)

func testTermsGrow(t *testing.T, s leader.Store) {
	name := newName()
	candidates := []leader.Candidate{newCandidate("alice"), newCandidate("bob"), newCandidate("carol")}
	var last uint64
	grant := func(c leader.Candidate, ttl time.Duration) leader.Lease {
		t.Helper()
		l := mustGrant(t, s, name, c, ttl)
		if last != 0 && l.Term != last+1 {
			t.Fatalf("grant to %s has term %d after term %d; want %d", c.ID, l.Term, last, last+1)
		}
		if l.Term <= last {
			t.Fatalf("grant to %s has term %d after term %d; terms never go back", c.ID, l.Term, last)
		}
		last = l.Term
		if o := observe(t, s, name); o.Term != last {
			t.Fatalf("Observe after granting term %d reports term %d", last, o.Term)
		}
		return l
	}
	for i := range 12 {
		c := candidates[i%len(candidates)]
		l := grant(c, longTTL)
		switch i % 3 {
		case 0: // handed over by release
			mustRelease(t, s, name, c, l.Term)
		case 1: // re-granted to the holder, then released
			l = grant(c, longTTL)
			mustRelease(t, s, name, c, l.Term)
		case 2: // renewed, then released
			mustRenew(t, s, name, c, l.Term, longTTL)
			mustRelease(t, s, name, c, l.Term)
		}
		if o := observe(t, s, name); o.Term != last || o.Held() {
			t.Fatalf("Observe after releasing term %d = %s; want a free lease with the same term", last, fmtLease(o))
		}
	}
	// Handed over by expiry, twice, to alternating candidates.
	for i := range 2 {
		grant(candidates[i%2], shortTTL)
		waitFree(t, s, name, shortTTL)
		if o := observe(t, s, name); o.Term != last {
			t.Fatalf("Observe after term %d expired reports term %d", last, o.Term)
		}
	}
	grant(candidates[2], longTTL)
}
