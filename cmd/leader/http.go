//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/leaderhttp"
)

// listenAddr normalises --http: "" stays "" (no server); a bare port
// (":9090" or "9090") listens on the loopback address 127.0.0.1, so that
// status and metrics are not exposed to the network unless a host is named
// (for example 0.0.0.0:9090).
func listenAddr(s string) (string, error) {
	if s == "" {
		return "", nil
	}
	if !strings.Contains(s, ":") {
		s = ":" + s
	}
	host, port, err := net.SplitHostPort(s)
	if err != nil || port == "" {
		return "", usagef("--http %q: want HOST:PORT or :PORT", s)
	}
	if host == "" {
		host = "127.0.0.1"
	}
	return net.JoinHostPort(host, port), nil
}

type httpServer struct {
	srv  *http.Server
	done chan struct{}
}

// serveHTTP serves the elector's /healthz, /leader and /metrics (from
// registry) on addr until shutdown.
func serveHTTP(addr string, e *leader.Elector, registry *prometheus.Registry, log *slog.Logger) (*httpServer, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	s := &httpServer{
		srv: &http.Server{
			Handler:           leaderhttp.Handler(e, leaderhttp.Options{Gatherer: registry}),
			ReadHeaderTimeout: 5 * time.Second,
			ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
		},
		done: make(chan struct{}),
	}
	log.Info("serving /healthz, /leader and /metrics", slog.String("addr", "http://"+ln.Addr().String()))
	go func() {
		defer close(s.done)
		if err := s.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("HTTP server stopped", slog.Any("error", err))
		}
	}()
	return s, nil
}

func (s *httpServer) shutdown() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_ = s.srv.Shutdown(ctx)
	<-s.done
}
