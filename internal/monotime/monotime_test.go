//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package monotime

import (
	"testing"
	"time"
)

func TestNowAdvancesWithTheRuntimeClock(t *testing.T) {
	a, err := Now()
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	time.Sleep(20 * time.Millisecond) // the interval being measured
	b, err := Now()
	if err != nil {
		t.Fatal(err)
	}
	elapsed := time.Since(start)
	if d := time.Duration(b - a); d < 20*time.Millisecond || d > elapsed+50*time.Millisecond {
		t.Errorf("CLOCK_MONOTONIC advanced %v while the runtime measured %v", d, elapsed)
	}
}
