package leaderprom_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/goleak"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/leaderprom"
	"github.com/leaderelect/leader/leadertest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// setup returns a Metrics registered on a fresh registry, and the registry.
func setup(t *testing.T, opts ...leaderprom.Option) (*leaderprom.Metrics, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	m, err := leaderprom.New(reg, opts...)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return m, reg
}

// find returns the series of metric family name whose labels include all of
// labels, or nil.
func find(t *testing.T, reg prometheus.Gatherer, name string, labels map[string]string) *dto.Metric {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatalf("Gather: %v", err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	series:
		for _, m := range f.GetMetric() {
			have := make(map[string]string)
			for _, lp := range m.GetLabel() {
				have[lp.GetName()] = lp.GetValue()
			}
			for k, v := range labels {
				if have[k] != v {
					continue series
				}
			}
			return m
		}
	}
	return nil
}

// value returns the value of a gauge or counter series, failing the test if
// there is no such series.
func value(t *testing.T, reg prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	m := find(t, reg, name, labels)
	switch {
	case m == nil:
		t.Fatalf("no series %s%v", name, labels)
	case m.Gauge != nil:
		return m.GetGauge().GetValue()
	case m.Counter != nil:
		return m.GetCounter().GetValue()
	}
	t.Fatalf("series %s%v is neither a gauge nor a counter", name, labels)
	return 0
}

// histogramCount returns the number of observations in a histogram series,
// or 0 if there is no such series.
func histogramCount(t *testing.T, reg prometheus.Gatherer, name string, labels map[string]string) uint64 {
	t.Helper()
	return find(t, reg, name, labels).GetHistogram().GetSampleCount()
}

func el(name string, kv ...string) map[string]string {
	l := map[string]string{"election": name}
	for i := 0; i+1 < len(kv); i += 2 {
		l[kv[i]] = kv[i+1]
	}
	return l
}

func TestMethods(t *testing.T) {
	t.Parallel()

	t.Run("a grant and a loss set the gauges and count the transitions", func(t *testing.T) {
		t.Parallel()
		m, reg := setup(t)
		m.Acquired("jobs", 7)
		m.Granted("jobs", 7, leader.GrantTransfer)
		m.StatusChanged("jobs", true)
		if got := value(t, reg, "leader_is_leader", el("jobs")); got != 1 {
			t.Errorf("leader_is_leader while leading = %v, want 1", got)
		}
		m.StatusChanged("jobs", false)
		m.Lost("jobs", leader.LossExpired)

		want := `
# HELP leader_is_leader 1 while this instance leads the election, 0 otherwise.
# TYPE leader_is_leader gauge
leader_is_leader{election="jobs"} 0
# HELP leader_term Fencing term of the latest grant of the election to this instance.
# TYPE leader_term gauge
leader_term{election="jobs"} 7
# HELP leader_transitions_total Times this instance became leader (transition="acquired") or stopped leading (transition="lost").
# TYPE leader_transitions_total counter
leader_transitions_total{election="jobs",transition="acquired"} 1
leader_transitions_total{election="jobs",transition="lost"} 1
# HELP leader_losses_total Leaderships this instance lost, by reason: shutdown, resigned, expired, conn_lost, error or transferred.
# TYPE leader_losses_total counter
leader_losses_total{election="jobs",reason="conn_lost"} 0
leader_losses_total{election="jobs",reason="error"} 0
leader_losses_total{election="jobs",reason="expired"} 1
leader_losses_total{election="jobs",reason="resigned"} 0
leader_losses_total{election="jobs",reason="shutdown"} 0
leader_losses_total{election="jobs",reason="transferred"} 0
# HELP leader_grants_total Leaderships this instance won, by how leadership moved: first, release, expiry, transfer or priority.
# TYPE leader_grants_total counter
leader_grants_total{election="jobs",reason="expiry"} 0
leader_grants_total{election="jobs",reason="first"} 0
leader_grants_total{election="jobs",reason="priority"} 0
leader_grants_total{election="jobs",reason="release"} 0
leader_grants_total{election="jobs",reason="transfer"} 1
`
		if err := testutil.GatherAndCompare(reg, strings.NewReader(want),
			"leader_is_leader", "leader_term", "leader_transitions_total", "leader_losses_total", "leader_grants_total"); err != nil {
			t.Error(err)
		}
	})

	t.Run("store calls are timed by op and errors counted", func(t *testing.T) {
		t.Parallel()
		m, reg := setup(t)
		m.StoreCall("jobs", "acquire", 3*time.Millisecond, nil)
		m.StoreCall("jobs", "renew", 2*time.Millisecond, nil)
		m.StoreCall("jobs", "renew", 40*time.Millisecond, errors.New("connection reset"))
		m.StoreCall("jobs", "release", time.Millisecond, nil)

		for op, want := range map[string]uint64{"acquire": 1, "renew": 2, "release": 1} {
			if got := histogramCount(t, reg, "leader_store_call_duration_seconds", el("jobs", "op", op)); got != want {
				t.Errorf("store_call_duration_seconds count for %s = %d, want %d", op, got, want)
			}
		}
		h := find(t, reg, "leader_store_call_duration_seconds", el("jobs", "op", "renew")).GetHistogram()
		if got, want := h.GetSampleSum(), 0.042; got < want-1e-9 || got > want+1e-9 {
			t.Errorf("renew duration sum = %v, want %v", got, want)
		}
		for op, want := range map[string]float64{"acquire": 0, "renew": 1, "release": 0, "observe": 0} {
			if got := value(t, reg, "leader_store_call_errors_total", el("jobs", "op", op)); got != want {
				t.Errorf("store_call_errors_total for %s = %v, want %v", op, got, want)
			}
		}
	})

	t.Run("an election's series appear at zero on its first store call", func(t *testing.T) {
		t.Parallel()
		m, reg := setup(t)
		m.StoreCall("jobs", "acquire", time.Millisecond, nil)
		if got := value(t, reg, "leader_is_leader", el("jobs")); got != 0 {
			t.Errorf("leader_is_leader = %v, want 0", got)
		}
		if got := value(t, reg, "leader_term", el("jobs")); got != 0 {
			t.Errorf("leader_term = %v, want 0", got)
		}
		for _, r := range []string{"shutdown", "resigned", "expired", "conn_lost", "error"} {
			if got := value(t, reg, "leader_losses_total", el("jobs", "reason", r)); got != 0 {
				t.Errorf("leader_losses_total for %s = %v, want 0", r, got)
			}
		}
		for _, tr := range []string{"acquired", "lost"} {
			if got := value(t, reg, "leader_transitions_total", el("jobs", "transition", tr)); got != 0 {
				t.Errorf("leader_transitions_total for %s = %v, want 0", tr, got)
			}
		}
	})

	t.Run("elections are kept apart by the election label", func(t *testing.T) {
		t.Parallel()
		m, reg := setup(t)
		m.StatusChanged("a", true)
		m.StatusChanged("b", true)
		m.StatusChanged("b", false)
		if got := value(t, reg, "leader_is_leader", el("a")); got != 1 {
			t.Errorf("leader_is_leader{a} = %v, want 1", got)
		}
		if got := value(t, reg, "leader_is_leader", el("b")); got != 0 {
			t.Errorf("leader_is_leader{b} = %v, want 0", got)
		}
	})

	t.Run("concurrent calls are all counted", func(t *testing.T) {
		t.Parallel()
		m, reg := setup(t)
		const workers, calls = 8, 200
		var wg sync.WaitGroup
		for range workers {
			wg.Go(func() {
				for range calls {
					m.StoreCall("jobs", "renew", time.Millisecond, errors.New("boom"))
					m.Lost("jobs", leader.LossConnLost)
					m.StatusChanged("jobs", true)
				}
			})
		}
		wg.Wait()
		if got := value(t, reg, "leader_store_call_errors_total", el("jobs", "op", "renew")); got != workers*calls {
			t.Errorf("errors = %v, want %d", got, workers*calls)
		}
		if got := value(t, reg, "leader_losses_total", el("jobs", "reason", "conn_lost")); got != workers*calls {
			t.Errorf("losses = %v, want %d", got, workers*calls)
		}
		if got := histogramCount(t, reg, "leader_store_call_duration_seconds", el("jobs", "op", "renew")); got != workers*calls {
			t.Errorf("histogram count = %d, want %d", got, workers*calls)
		}
	})
}

func TestNew(t *testing.T) {
	t.Parallel()

	t.Run("registering twice on one registry is a clear error", func(t *testing.T) {
		t.Parallel()
		_, reg := setup(t)
		m, err := leaderprom.New(reg)
		if err == nil {
			t.Fatal("second New on the same registry succeeded")
		}
		if m != nil {
			t.Errorf("second New returned a Metrics along with its error")
		}
		var already prometheus.AlreadyRegisteredError
		if !errors.As(err, &already) {
			t.Errorf("error %v does not wrap a prometheus.AlreadyRegisteredError", err)
		}
		if !strings.Contains(err.Error(), `namespace "leader"`) {
			t.Errorf("error %q does not name the namespace", err)
		}
	})

	t.Run("another namespace on the same registry is fine", func(t *testing.T) {
		t.Parallel()
		_, reg := setup(t)
		m, err := leaderprom.New(reg, leaderprom.WithNamespace("jobs_leader"))
		if err != nil {
			t.Fatalf("New with another namespace: %v", err)
		}
		m.StatusChanged("x", true)
		if got := value(t, reg, "jobs_leader_is_leader", el("x")); got != 1 {
			t.Errorf("jobs_leader_is_leader = %v, want 1", got)
		}
	})

	t.Run("a nil registerer is refused", func(t *testing.T) {
		t.Parallel()
		if _, err := leaderprom.New(nil); err == nil {
			t.Error("New(nil) succeeded")
		}
	})

	t.Run("a clashing metric refuses the whole set", func(t *testing.T) {
		t.Parallel()
		reg := prometheus.NewRegistry()
		// Same name, different label set and help: refused by the registry.
		reg.MustRegister(prometheus.NewGauge(prometheus.GaugeOpts{Name: "leader_term", Help: "something else"}))
		if _, err := leaderprom.New(reg); err == nil {
			t.Fatal("New succeeded despite a clashing leader_term")
		}
		families, err := reg.Gather()
		if err != nil {
			t.Fatalf("Gather: %v", err)
		}
		if len(families) != 1 {
			t.Errorf("registry holds %d families after a refused New, want only the clashing one", len(families))
		}
	})

	t.Run("const labels and buckets are applied", func(t *testing.T) {
		t.Parallel()
		m, reg := setup(t,
			leaderprom.WithConstLabels(prometheus.Labels{"service": "billing"}),
			leaderprom.WithBuckets([]float64{0.01, 0.1}))
		m.StoreCall("jobs", "observe", 50*time.Millisecond, nil)
		s := find(t, reg, "leader_store_call_duration_seconds", el("jobs", "op", "observe", "service", "billing"))
		if s == nil {
			t.Fatal("no histogram series with the const label service=billing")
		}
		var bounds []float64
		for _, b := range s.GetHistogram().GetBucket() {
			bounds = append(bounds, b.GetUpperBound())
		}
		if len(bounds) != 2 || bounds[0] != 0.01 || bounds[1] != 0.1 {
			t.Errorf("bucket bounds = %v, want [0.01 0.1]", bounds)
		}
	})
}

func TestWithElector(t *testing.T) {
	t.Parallel()
	m, reg := setup(t)
	elected := make(chan struct{}, 1)
	e, err := leader.New(leadertest.NewMemStore(), leader.Config{
		Name:    "nightly-report",
		ID:      "worker-1",
		TTL:     time.Second,
		Logger:  slog.New(slog.DiscardHandler),
		Metrics: m,
		OnElected: func(context.Context) {
			select {
			case elected <- struct{}{}:
			default:
			}
		},
	})
	if err != nil {
		t.Fatalf("leader.New: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-done
	})

	select {
	case <-elected:
	case <-time.After(5 * time.Second):
		t.Fatal("not elected within 5s")
	}
	name := el("nightly-report")
	if got := value(t, reg, "leader_is_leader", name); got != 1 {
		t.Errorf("leader_is_leader while leading = %v, want 1", got)
	}
	if got, want := value(t, reg, "leader_term", name), float64(e.Status().Term); got != want || want == 0 {
		t.Errorf("leader_term = %v, want the granted term %v (not 0)", got, want)
	}
	if got := value(t, reg, "leader_transitions_total", el("nightly-report", "transition", "acquired")); got != 1 {
		t.Errorf("acquired transitions = %v, want 1", got)
	}
	if got := histogramCount(t, reg, "leader_store_call_duration_seconds", el("nightly-report", "op", "acquire")); got < 1 {
		t.Errorf("acquire calls timed = %d, want at least 1", got)
	}

	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Run did not return within 5s of its context ending")
	}
	done <- nil // for the cleanup

	if got := value(t, reg, "leader_is_leader", name); got != 0 {
		t.Errorf("leader_is_leader after shutdown = %v, want 0", got)
	}
	if got := value(t, reg, "leader_losses_total", el("nightly-report", "reason", "shutdown")); got != 1 {
		t.Errorf("losses for shutdown = %v, want 1", got)
	}
	if got := value(t, reg, "leader_transitions_total", el("nightly-report", "transition", "lost")); got != 1 {
		t.Errorf("lost transitions = %v, want 1", got)
	}
	if got := histogramCount(t, reg, "leader_store_call_duration_seconds", el("nightly-report", "op", "release")); got != 1 {
		t.Errorf("release calls timed = %d, want 1", got)
	}
	if got := value(t, reg, "leader_store_call_errors_total", el("nightly-report", "op", "release")); got != 0 {
		t.Errorf("release errors = %v, want 0", got)
	}
}
