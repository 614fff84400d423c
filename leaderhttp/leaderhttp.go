// Package leaderhttp serves an Elector's health and status over HTTP, for
// load balancers, orchestrators' probes and people.
//
// Handler serves three paths:
//
//	GET /healthz  200 "ok" while the Elector is in touch with its store;
//	              503 with the reason when it is not (see below)
//	GET /leader   the Elector's Status as JSON, plus ttl_seconds
//	GET /metrics  the Prometheus metrics of Options.Gatherer, if set; else 404
//
// Other paths answer 404 and other methods 405. Mount it at the root of a
// mux, or under a prefix with http.StripPrefix.
//
// # Health
//
// Leading or following, a healthy Elector talks to its store at least once
// per lease: the leader renews every RenewInterval, and a follower asks again
// at the latest when the lease it was told about runs out. /healthz reports
// the Elector as wedged when its last successful store call
// (Status.LastContact) is older than MaxSilence, by default TTL +
// RenewInterval: a follower may wait a whole TTL between calls, and a call
// may take up to RenewInterval. Before the first successful call, the same
// limit is counted from the moment Handler was called, so an Elector whose
// Run was never started, or whose store was never reachable, is reported too.
//
// /healthz also reports the Elector as unhealthy, at once, while the store
// refuses its calls for a reason that retrying will not mend
// (Status.Problem: a wrong password, tables never migrated, missing
// privileges; see leader.ErrPermanent).
//
// Whether this instance leads does not affect /healthz: a follower is
// healthy. Use /leader, or Elector.IsLeader, to route by leadership.
package leaderhttp

import (
	"encoding/json"
	"fmt"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/leaderelect/leader"
)

// Options configures Handler. The zero value serves /healthz and /leader
// with the default health limit and no /metrics.
type Options struct {
	// Gatherer, if set, is served at /metrics in the Prometheus exposition
	// formats (with promhttp.HandlerFor), for example the registry the
	// leaderprom metrics are on. If nil, /metrics answers 404.
	Gatherer prometheus.Gatherer

	// MaxSilence is how long the Elector may go without a successful store
	// call before /healthz reports it wedged. Default (zero): the Elector's
	// TTL + RenewInterval. A value below TTL + RenewInterval will report
	// healthy followers as wedged from time to time.
	MaxSilence time.Duration

	// Now returns the current time. Default time.Now; tests set it to drive
	// the health limit without waiting.
	Now func() time.Time
}

// Handler returns an http.Handler serving e's /healthz, /leader and /metrics
// as the package documentation describes. It panics if e is nil. The
// handler is safe for concurrent use and never blocks on the store: it
// reads e.Status.
func Handler(e *leader.Elector, opts Options) http.Handler {
	if e == nil {
		panic("leaderhttp: Handler: Elector is nil")
	}
	cfg := e.Config()
	if opts.MaxSilence <= 0 {
		opts.MaxSilence = cfg.TTL + cfg.RenewInterval
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	h := &handler{e: e, opts: opts, ttl: cfg.TTL, created: opts.Now()}

	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", h.healthz)
	mux.HandleFunc("GET /leader", h.leader)
	if opts.Gatherer != nil {
		mux.Handle("GET /metrics", promhttp.HandlerFor(opts.Gatherer, promhttp.HandlerOpts{}))
	} else {
		mux.HandleFunc("GET /metrics", http.NotFound)
	}
	return mux
}

type handler struct {
	e       *leader.Elector
	opts    Options
	ttl     time.Duration
	created time.Time // when Handler was called, on opts.Now
}

// unhealthy returns why the Elector is wedged, or "" if it is not.
func (h *handler) unhealthy(st leader.Status) string {
	if st.Problem != "" {
		return "the store refuses every call until its configuration is mended: " + st.Problem
	}
	now := h.opts.Now()
	if st.LastContact.IsZero() {
		if waited := now.Sub(h.created); waited > h.opts.MaxSilence {
			return fmt.Sprintf("no successful store call in the %v since the health handler started (limit %v); is Run running and the store reachable?",
				waited.Round(time.Millisecond), h.opts.MaxSilence)
		}
		return ""
	}
	if silent := now.Sub(st.LastContact); silent > h.opts.MaxSilence {
		return fmt.Sprintf("no successful store call for %v (limit %v), the last at %s",
			silent.Round(time.Millisecond), h.opts.MaxSilence, st.LastContact.UTC().Format(time.RFC3339Nano))
	}
	return ""
}

func (h *handler) healthz(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	if reason := h.unhealthy(h.e.Status()); reason != "" {
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintf(w, "unhealthy: %s\n", reason)
		return
	}
	fmt.Fprintln(w, "ok")
}

// statusJSON is the body of /leader: the Status with its own JSON names,
// plus the TTL.
type statusJSON struct {
	leader.Status
	TTLSeconds float64 `json:"ttl_seconds"`
}

func (h *handler) leader(w http.ResponseWriter, _ *http.Request) {
	body, err := json.MarshalIndent(statusJSON{Status: h.e.Status(), TTLSeconds: h.ttl.Seconds()}, "", "  ")
	if err != nil {
		http.Error(w, "encoding status: "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.Write(append(body, '\n'))
}
