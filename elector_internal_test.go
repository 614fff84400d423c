package leader

import (
	"math/rand/v2"
	"testing"
	"time"
)

// Renewals fall on the process's grid: after the request, at most one
// interval later, and the same for every request sent within one period.
func TestNextRenewalIsOnTheGridWithinOneInterval(t *testing.T) {
	for _, every := range []time.Duration{time.Millisecond, 333 * time.Millisecond, 5 * time.Second, time.Hour} {
		for range 1000 {
			sent := renewEpoch.Add(time.Duration(rand.Int64N(int64(100 * every))))
			next := nextRenewal(sent, every)
			if !next.After(sent) || next.After(sent.Add(every)) {
				t.Fatalf("nextRenewal(epoch+%v, %v) = epoch+%v: want after the request and at most one interval later",
					sent.Sub(renewEpoch), every, next.Sub(renewEpoch))
			}
			if off := next.Sub(renewEpoch) % every; off != 0 {
				t.Fatalf("nextRenewal(epoch+%v, %v) = epoch+%v: %v off the grid", sent.Sub(renewEpoch), every, next.Sub(renewEpoch), off)
			}
			// Any other request of the same period of the grid renews at
			// the same moment.
			start := sent.Add(-(sent.Sub(renewEpoch) % every))
			other := start.Add(time.Duration(rand.Int64N(int64(every))))
			if o := nextRenewal(other, every); !o.Equal(next) {
				t.Fatalf("requests sent at epoch+%v and epoch+%v (one period of %v) renew at epoch+%v and epoch+%v",
					sent.Sub(renewEpoch), other.Sub(renewEpoch), every, next.Sub(renewEpoch), o.Sub(renewEpoch))
			}
		}
	}
}
