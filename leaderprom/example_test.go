package leaderprom_test

import (
	"context"
	"fmt"
	"log"
	"log/slog"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/leaderprom"
	"github.com/leaderelect/leader/leadertest"
)

// Register the metrics on the service's own registry and hand them to the
// Elector; serve the registry with promhttp.HandlerFor (or leaderhttp).
func Example() {
	reg := prometheus.NewRegistry()
	metrics, err := leaderprom.New(reg)
	if err != nil {
		log.Fatal(err)
	}

	elected := make(chan struct{}, 1)
	e, err := leader.New(leadertest.NewMemStore(), leader.Config{
		Name:    "nightly-report",
		Metrics: metrics,
		Logger:  slog.New(slog.DiscardHandler),
		OnElected: func(context.Context) {
			select {
			case elected <- struct{}{}:
			default:
			}
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	<-elected

	families, err := reg.Gather()
	if err != nil {
		log.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() == "leader_is_leader" || f.GetName() == "leader_term" {
			for _, m := range f.GetMetric() {
				fmt.Printf("%s{election=%q} %v\n", f.GetName(), m.GetLabel()[0].GetValue(), m.GetGauge().GetValue())
			}
		}
	}

	cancel()
	if err := <-done; err != nil {
		log.Fatal(err)
	}
	// Output:
	// leader_is_leader{election="nightly-report"} 1
	// leader_term{election="nightly-report"} 1
}
