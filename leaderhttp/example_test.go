package leaderhttp_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/leaderhttp"
	"github.com/leaderelect/leader/leaderprom"
	"github.com/leaderelect/leader/leadertest"
)

// Serve health, status and metrics next to the service's own routes. Here the
// requests are made in-process; a service would call
// http.ListenAndServe(":8080", mux).
func Example() {
	reg := prometheus.NewRegistry()
	metrics, err := leaderprom.New(reg)
	if err != nil {
		log.Fatal(err)
	}
	elected := make(chan struct{}, 1)
	e, err := leader.New(leadertest.NewMemStore(), leader.Config{
		Name:    "nightly-report",
		ID:      "worker-1",
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

	mux := http.NewServeMux()
	mux.Handle("/election/", http.StripPrefix("/election", leaderhttp.Handler(e, leaderhttp.Options{Gatherer: reg})))

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	<-elected

	rec := httptest.NewRecorder()
	mux.ServeHTTP(rec, httptest.NewRequest("GET", "/election/healthz", nil))
	fmt.Print(rec.Code, " ", rec.Body.String())

	rec = httptest.NewRecorder()
	mux.ServeHTTP(rec, httptest.NewRequest("GET", "/election/leader", nil))
	var st leader.Status
	if err := json.Unmarshal(rec.Body.Bytes(), &st); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%d name=%s leader=%s is_leader=%v term=%d\n", rec.Code, st.Name, st.Leader, st.IsLeader, st.Term)

	cancel()
	if err := <-done; err != nil {
		log.Fatal(err)
	}
	// Output:
	// 200 ok
	// 200 name=nightly-report leader=worker-1 is_leader=true term=1
}
