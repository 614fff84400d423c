//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package monotime

import (
	"testing"
	"time"
)

func TestNowAdvancesWithTheRuntimeClock(t *testing.T) {
	// The runtime's interval, from start to elapsed, contains the one
	// measured with Now, from a to b, however late the test is scheduled.
	start := time.Now()
	a, err := Now()
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond) // the interval being measured
	b, err := Now()
	if err != nil {
		t.Fatal(err)
	}
	elapsed := time.Since(start)
	// The slack is for a runtime clock other than CLOCK_MONOTONIC (as on
	// macOS); on Linux they are the same clock.
	const slack = 10 * time.Millisecond
	if d := time.Duration(b - a); d < 20*time.Millisecond || d > elapsed+slack {
		t.Errorf("CLOCK_MONOTONIC advanced %v while the runtime measured %v around it", d, elapsed)
	}
}
