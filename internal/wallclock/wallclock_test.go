package wallclock

import (
	"strings"
	"testing"
	"time"
)

func TestStepMovesNowAndCarriesNoMonotonicReading(t *testing.T) {
	t.Cleanup(func() { Step(-Offset()) })
	before := Now()
	Step(time.Hour)
	after := Now()
	if d := after.Sub(before); d < time.Hour || d > time.Hour+time.Minute {
		t.Fatalf("after a step of 1h, Now moved by %v", d)
	}
	if Offset() != time.Hour {
		t.Fatalf("Offset() = %v, want 1h", Offset())
	}
	// A time with a monotonic reading prints it as "m=+..."; Now's must not.
	if s := after.String(); strings.Contains(s, "m=") {
		t.Fatalf("Now() = %s carries a monotonic reading", s)
	}
	Step(-2 * time.Hour)
	if d := Now().Sub(before); d > 0 {
		t.Fatalf("after stepping back 2h, Now is %v after the first reading", d)
	}
}
