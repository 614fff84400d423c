package leader

import "time"

// LossReason says why leadership ended. It is passed to Metrics.Lost and
// appears in logs.
type LossReason string

// The reasons leadership can end.
const (
	// LossShutdown: Run's context ended; the lease was released (handover).
	LossShutdown LossReason = "shutdown"
	// LossResigned: Resign was called; the lease was released (handover).
	LossResigned LossReason = "resigned"
	// LossExpired: the store said the lease is no longer held by this
	// instance (it ran out, or was granted to another).
	LossExpired LossReason = "expired"
	// LossConnLost: renewals could not reach the store until the local
	// deadline drew near.
	LossConnLost LossReason = "conn_lost"
	// LossError: the store refused renewals with another error, for example
	// because it became read-only.
	LossError LossReason = "error"
	// LossTransferred: this instance handed the lease over to a chosen
	// successor (Elector.Transfer, a request from RequestTransfer, or a
	// candidate with a higher Config.Priority).
	LossTransferred LossReason = "transferred"
)

// Metrics receives what an Elector does, for counters and gauges. Methods are
// called synchronously from the Elector's goroutines and must not block. A
// Prometheus implementation is in package leaderprom; embed NopMetrics to
// implement only some methods.
type Metrics interface {
	// StatusChanged is called when this instance becomes leader (true) or
	// stops being leader (false).
	StatusChanged(name string, isLeader bool)
	// Acquired is called once per grant to this instance, with its term.
	Acquired(name string, term uint64)
	// Lost is called once per leadership lost, with the reason.
	Lost(name string, reason LossReason)
	// StoreCall is called after each store call: op is "acquire",
	// "renew", "release" (a handover's too) or "observe", and, on a store
	// that can hand leases over, "enlist", "withdraw", "candidates",
	// "request_transfer", "prepare_handover" or "stage_handover"; err is
	// the call's error, if any.
	StoreCall(name, op string, took time.Duration, err error)
}

// GrantMetrics is implemented by a Metrics that counts grants by why they
// were made. The Elector calls Granted, where the Metrics implements it,
// right after Acquired, with the Lease.Reason its store reported (empty
// for a first grant, or a store that does not record reasons).
type GrantMetrics interface {
	Granted(name string, term uint64, reason GrantReason)
}

// NopMetrics implements Metrics and does nothing.
type NopMetrics struct{}

// StatusChanged does nothing.
func (NopMetrics) StatusChanged(string, bool) {}

// Acquired does nothing.
func (NopMetrics) Acquired(string, uint64) {}

// Lost does nothing.
func (NopMetrics) Lost(string, LossReason) {}

// StoreCall does nothing.
func (NopMetrics) StoreCall(string, string, time.Duration, error) {}
