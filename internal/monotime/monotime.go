// Package monotime reads the host's CLOCK_MONOTONIC, for deadlines that
// several processes on one host must agree on. Go's own monotonic readings
// are relative to each process's start, so they cannot cross a process
// boundary; CLOCK_MONOTONIC values can. The clock is never set or stepped
// (only slewed), and starts again near zero at every boot.
package monotime
