// Package leaderprom reports what Electors do as Prometheus metrics: it
// implements leader.Metrics on a registry the caller chooses.
//
//	reg := prometheus.NewRegistry()
//	m, err := leaderprom.New(reg)
//	if err != nil {
//		return err
//	}
//	e, err := leader.New(store, leader.Config{Name: "nightly-report", Metrics: m})
//
// One Metrics may serve any number of Electors; every series carries the
// election name in the label "election". The metrics, with the default
// namespace "leader":
//
//	leader_is_leader{election}                       gauge: 1 while this instance leads, else 0
//	leader_term{election}                            gauge: fencing term of this instance's latest grant
//	leader_transitions_total{election,transition}    counter: transition is "acquired" or "lost"
//	leader_losses_total{election,reason}             counter: leaderships lost, by leader.LossReason:
//	                                                 shutdown, resigned, expired, conn_lost, error
//	                                                 or transferred
//	leader_grants_total{election,reason}             counter: leaderships won, by how leadership
//	                                                 moved (leader.GrantReason): first, release,
//	                                                 expiry, transfer or priority
//	leader_store_call_duration_seconds{election,op}  histogram: store call latency; op is
//	                                                 acquire, renew, release, observe, enlist,
//	                                                 withdraw, candidates or request_transfer
//	leader_store_call_errors_total{election,op}      counter: store calls that returned an error
//
// The series of an election appear, at zero, on the first call that names it,
// so that rate() and alerts on absent series work from the start: an Elector
// makes its first store call as soon as Run starts.
//
// Nothing is registered on prometheus.DefaultRegisterer unless the caller
// passes it, and the package holds no global state: two Metrics with
// different namespaces (or on different registries) are independent.
package leaderprom

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/leaderelect/leader"
)

// Label names used on the metrics.
const (
	labelElection   = "election"
	labelTransition = "transition"
	labelReason     = "reason"
	labelOp         = "op"
)

// Values of the transition label.
const (
	transitionAcquired = "acquired"
	transitionLost     = "lost"
)

// The reasons and ops known in advance, whose series are created at zero.
var (
	knownReasons = []leader.LossReason{
		leader.LossShutdown, leader.LossResigned, leader.LossExpired, leader.LossConnLost, leader.LossError, leader.LossTransferred,
	}
	knownGrants = []string{
		grantLabel(leader.GrantFirst), string(leader.GrantRelease), string(leader.GrantExpiry), string(leader.GrantTransfer), string(leader.GrantPriority),
	}
	knownOps = []string{"acquire", "renew", "release", "observe"}
)

// grantLabel is the reason label of a grant: "first" for GrantFirst, whose
// value is empty.
func grantLabel(r leader.GrantReason) string {
	if r == leader.GrantFirst {
		return "first"
	}
	return string(r)
}

// DefaultNamespace prefixes every metric name unless WithNamespace says
// otherwise.
const DefaultNamespace = "leader"

// defaultBuckets are the store call latency histogram buckets, in seconds:
// from 1ms (an embedded store) to 10s (a call that ran into its timeout).
func defaultBuckets() []float64 {
	return []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10}
}

// Option changes how New builds a Metrics.
type Option func(*options)

type options struct {
	namespace   string
	buckets     []float64
	constLabels prometheus.Labels
}

// WithNamespace sets the prefix of every metric name (default
// DefaultNamespace, "leader"). The empty string means no prefix.
func WithNamespace(ns string) Option {
	return func(o *options) { o.namespace = ns }
}

// WithBuckets sets the upper bounds, in seconds, of the store call latency
// histogram's buckets. The default is 1ms, 2.5ms, 5ms, 10ms, 25ms, 50ms,
// 100ms, 250ms, 500ms, 1s, 2.5s, 5s and 10s: from an embedded store to a call
// that ran into its timeout.
func WithBuckets(b []float64) Option {
	return func(o *options) { o.buckets = append([]float64(nil), b...) }
}

// WithConstLabels adds labels with fixed values to every series, for example
// the service's name.
func WithConstLabels(l prometheus.Labels) Option {
	return func(o *options) {
		o.constLabels = make(prometheus.Labels, len(l))
		for k, v := range l {
			o.constLabels[k] = v
		}
	}
}

// Metrics implements leader.Metrics with Prometheus collectors. Create it
// with New. Its methods do not block beyond a short lock inside the
// collectors and are safe for concurrent use by any number of Electors.
type Metrics struct {
	isLeader      *prometheus.GaugeVec
	term          *prometheus.GaugeVec
	transitions   *prometheus.CounterVec
	losses        *prometheus.CounterVec
	grants        *prometheus.CounterVec
	storeDuration *prometheus.HistogramVec
	storeErrors   *prometheus.CounterVec

	seen sync.Map // election name -> struct{}: series created at zero
}

var (
	_ leader.Metrics      = (*Metrics)(nil)
	_ leader.GrantMetrics = (*Metrics)(nil)
)

// New returns a Metrics registered on reg. It returns an error, and
// registers nothing, if reg is nil or refuses the metrics, for example
// because a Metrics with the same namespace is already registered on it;
// that error wraps the registry's (a prometheus.AlreadyRegisteredError in the
// latter case).
func New(reg prometheus.Registerer, opts ...Option) (*Metrics, error) {
	if reg == nil {
		return nil, errors.New("leaderprom: New: Registerer is nil (pass a registry, for example prometheus.NewRegistry())")
	}
	o := options{namespace: DefaultNamespace, buckets: defaultBuckets()}
	for _, opt := range opts {
		opt(&o)
	}
	m := &Metrics{
		isLeader: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: o.namespace, Name: "is_leader", ConstLabels: o.constLabels,
			Help: "1 while this instance leads the election, 0 otherwise.",
		}, []string{labelElection}),
		term: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: o.namespace, Name: "term", ConstLabels: o.constLabels,
			Help: "Fencing term of the latest grant of the election to this instance.",
		}, []string{labelElection}),
		transitions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: o.namespace, Name: "transitions_total", ConstLabels: o.constLabels,
			Help: "Times this instance became leader (transition=\"acquired\") or stopped leading (transition=\"lost\").",
		}, []string{labelElection, labelTransition}),
		losses: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: o.namespace, Name: "losses_total", ConstLabels: o.constLabels,
			Help: "Leaderships this instance lost, by reason: shutdown, resigned, expired, conn_lost, error or transferred.",
		}, []string{labelElection, labelReason}),
		grants: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: o.namespace, Name: "grants_total", ConstLabels: o.constLabels,
			Help: "Leaderships this instance won, by how leadership moved: first, release, expiry, transfer or priority.",
		}, []string{labelElection, labelReason}),
		storeDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: o.namespace, Name: "store_call_duration_seconds", ConstLabels: o.constLabels,
			Help:    "Duration of calls to the store, by op: acquire, renew, release or observe.",
			Buckets: o.buckets,
		}, []string{labelElection, labelOp}),
		storeErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: o.namespace, Name: "store_call_errors_total", ConstLabels: o.constLabels,
			Help: "Calls to the store that returned an error, by op: acquire, renew, release or observe.",
		}, []string{labelElection, labelOp}),
	}
	// One collector for all seven, so that registration succeeds or fails
	// as a whole and a refused New leaves nothing behind on reg.
	if err := reg.Register(collector{m}); err != nil {
		return nil, fmt.Errorf("leaderprom: registering metrics with namespace %q (is another leaderprom.Metrics with this namespace on the registry?): %w", o.namespace, err)
	}
	return m, nil
}

// StatusChanged implements leader.Metrics: it sets leader_is_leader and
// counts a transition.
func (m *Metrics) StatusChanged(name string, isLeader bool) {
	m.init(name)
	if isLeader {
		m.isLeader.WithLabelValues(name).Set(1)
		m.transitions.WithLabelValues(name, transitionAcquired).Inc()
		return
	}
	m.isLeader.WithLabelValues(name).Set(0)
	m.transitions.WithLabelValues(name, transitionLost).Inc()
}

// Acquired implements leader.Metrics: it sets leader_term. Terms above 2^53
// lose precision in the float64 a gauge holds.
func (m *Metrics) Acquired(name string, term uint64) {
	m.init(name)
	m.term.WithLabelValues(name).Set(float64(term))
}

// Lost implements leader.Metrics: it counts the loss under its reason.
func (m *Metrics) Lost(name string, reason leader.LossReason) {
	m.init(name)
	m.losses.WithLabelValues(name, string(reason)).Inc()
}

// Granted implements leader.GrantMetrics: it counts the grant under its
// reason.
func (m *Metrics) Granted(name string, _ uint64, reason leader.GrantReason) {
	m.init(name)
	m.grants.WithLabelValues(name, grantLabel(reason)).Inc()
}

// StoreCall implements leader.Metrics: it observes the call's duration and
// counts it as an error if err is not nil.
func (m *Metrics) StoreCall(name, op string, took time.Duration, err error) {
	m.init(name)
	m.storeDuration.WithLabelValues(name, op).Observe(took.Seconds())
	if err != nil {
		m.storeErrors.WithLabelValues(name, op).Inc()
	}
}

// init creates the series of election name at zero, once.
func (m *Metrics) init(name string) {
	if _, seen := m.seen.Load(name); seen {
		return
	}
	if _, seen := m.seen.LoadOrStore(name, struct{}{}); seen {
		return
	}
	m.isLeader.WithLabelValues(name)
	m.term.WithLabelValues(name)
	m.transitions.WithLabelValues(name, transitionAcquired)
	m.transitions.WithLabelValues(name, transitionLost)
	for _, r := range knownReasons {
		m.losses.WithLabelValues(name, string(r))
	}
	for _, r := range knownGrants {
		m.grants.WithLabelValues(name, r)
	}
	for _, op := range knownOps {
		m.storeErrors.WithLabelValues(name, op)
	}
}

// collector registers all of a Metrics' collectors as one.
type collector struct{ m *Metrics }

func (c collector) Describe(ch chan<- *prometheus.Desc) {
	c.m.isLeader.Describe(ch)
	c.m.term.Describe(ch)
	c.m.transitions.Describe(ch)
	c.m.losses.Describe(ch)
	c.m.grants.Describe(ch)
	c.m.storeDuration.Describe(ch)
	c.m.storeErrors.Describe(ch)
}

func (c collector) Collect(ch chan<- prometheus.Metric) {
	c.m.isLeader.Collect(ch)
	c.m.term.Collect(ch)
	c.m.transitions.Collect(ch)
	c.m.losses.Collect(ch)
	c.m.grants.Collect(ch)
	c.m.storeDuration.Collect(ch)
	c.m.storeErrors.Collect(ch)
}
