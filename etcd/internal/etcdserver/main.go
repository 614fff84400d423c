//go:build unix

// Command etcdserver runs one etcd member, for tests that need a cluster of
// members in separate processes (see package etcdtest, which builds and
// starts it).
//
// Usage:
//
//	etcdserver --name m0 --data-dir DIR \
//		--listen-client http://127.0.0.1:P0 --listen-peer http://127.0.0.1:Q0 \
//		--initial-cluster m0=http://127.0.0.1:Q0,m1=http://127.0.0.1:Q1,... \
//		[--initial-cluster-state new|existing] [--initial-cluster-token TOKEN] \
//		[--advertise-client URL] [--heartbeat-ms 100] [--election-ms 1000]
//
// The member advertises its --listen-peer URL to its peers, and its
// --advertise-client URL (by default its --listen-client URL) to clients:
// a test that puts a proxy in front of the member advertises the proxy.
//
// The member does not fsync (it is for tests), logs at level error to
// etcd.log in its data directory, and writes "ready" on a line of standard
// output once it serves clients. It exits, closing the server, on SIGTERM or
// SIGINT, and when its standard input closes: a test binary that dies
// without stopping its members takes them with it. It exits with status 1
// if the server fails to start or fails while running.
//
// With --watchdog DIR it runs no member: it reads lines "+PID" (watch
// process PID) and "-PID" (stop watching it) from standard input, and when
// standard input closes it kills every process still watched with SIGKILL
// and removes DIR. This covers what closing a member's standard input
// cannot: a member stopped with SIGSTOP never reads it.
package main

import (
	"bufio"
	"flag"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
)

// closeTimeout bounds the server's shutdown; a leader hands over its
// leadership first, which takes up to a few election timeouts.
const closeTimeout = 15 * time.Second

func main() {
	var (
		name         = flag.String("name", "default", "member `name`, unique in the cluster")
		dataDir      = flag.String("data-dir", "", "data `directory`; created if missing (required)")
		listenClient = flag.String("listen-client", "", "client `URL` to listen on (required)")
		advClient    = flag.String("advertise-client", "", "client `URL` to advertise (default: --listen-client)")
		listenPeer   = flag.String("listen-peer", "", "peer `URL` to listen on, and advertise (required)")
		cluster      = flag.String("initial-cluster", "", "every member, as `name=peerURL,...` (default: this member alone)")
		clusterState = flag.String("initial-cluster-state", embed.ClusterStateFlagNew, "`state`: new, or existing to rejoin from the data directory")
		clusterToken = flag.String("initial-cluster-token", "etcdtest", "`token` unique to the cluster, so that members of other clusters cannot join it")
		heartbeatMs  = flag.Uint("heartbeat-ms", 100, "heartbeat interval in `milliseconds`")
		electionMs   = flag.Uint("election-ms", 1000, "election timeout in `milliseconds`")
		watchdog     = flag.String("watchdog", "", "run as a watchdog that removes `directory` (see the package documentation)")
	)
	flag.Parse()
	if flag.NArg() > 0 {
		fail(fmt.Errorf("unexpected arguments %q", flag.Args()))
	}
	if *watchdog != "" {
		runWatchdog(*watchdog)
		return
	}
	if *dataDir == "" || *listenClient == "" || *listenPeer == "" {
		fail(fmt.Errorf("--data-dir, --listen-client and --listen-peer are required"))
	}

	cfg := embed.NewConfig()
	cfg.Name = *name
	cfg.Dir = *dataDir
	cfg.ListenClientUrls = []url.URL{parseURL("listen-client", *listenClient)}
	cfg.AdvertiseClientUrls = cfg.ListenClientUrls
	if *advClient != "" {
		cfg.AdvertiseClientUrls = []url.URL{parseURL("advertise-client", *advClient)}
	}
	cfg.ListenPeerUrls = []url.URL{parseURL("listen-peer", *listenPeer)}
	cfg.AdvertisePeerUrls = cfg.ListenPeerUrls
	cfg.InitialCluster = *cluster
	if cfg.InitialCluster == "" {
		cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	}
	cfg.ClusterState = *clusterState
	cfg.InitialClusterToken = *clusterToken
	cfg.TickMs, cfg.ElectionMs = *heartbeatMs, *electionMs
	cfg.UnsafeNoFsync = true
	cfg.LogLevel = "error"
	cfg.LogOutputs = []string{filepath.Join(*dataDir, "etcd.log")}

	// etcd wants its data directory private; the log goes in it.
	if err := os.MkdirAll(*dataDir, 0o700); err != nil {
		fail(err)
	}
	// Watch for the signals and standard input before starting, so that a
	// test that gives up during a slow start still stops the member.
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	stdinClosed := make(chan struct{})
	go func() {
		io.Copy(io.Discard, os.Stdin)
		close(stdinClosed)
	}()

	e, err := embed.StartEtcd(cfg)
	if err != nil {
		fail(err)
	}
	select {
	case <-e.Server.ReadyNotify():
		fmt.Println("ready")
	case err := <-e.Err():
		closeAndExit(e, err)
	case <-stop:
		closeAndExit(e, nil)
	case <-stdinClosed:
		closeAndExit(e, nil)
	}
	select {
	case err := <-e.Err():
		closeAndExit(e, err)
	case <-e.Server.StopNotify():
		closeAndExit(e, fmt.Errorf("server stopped"))
	case <-stop:
		closeAndExit(e, nil)
	case <-stdinClosed:
		closeAndExit(e, nil)
	}
}

// closeAndExit closes the server and exits: with status 1 if err is not
// nil, or if closing takes longer than closeTimeout; else with status 0.
func closeAndExit(e *embed.Etcd, err error) {
	closed := make(chan struct{})
	go func() {
		e.Close()
		close(closed)
	}()
	select {
	case <-closed:
	case <-time.After(closeTimeout):
		fail(fmt.Errorf("server not closed after %v", closeTimeout))
	}
	if err != nil {
		fail(err)
	}
	os.Exit(0)
}

func parseURL(flagName, s string) url.URL {
	u, err := url.Parse(s)
	if err != nil {
		fail(fmt.Errorf("--%s: %w", flagName, err))
	}
	return *u
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "etcdserver:", err)
	os.Exit(1)
}

// runWatchdog is the --watchdog mode: see the package documentation. It
// ignores SIGINT and SIGTERM, which a terminal or go test may send to the
// whole process group, so that it outlives the processes it watches.
func runWatchdog(dir string) {
	signal.Ignore(syscall.SIGINT, syscall.SIGTERM)
	watched := make(map[int]bool)
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if len(line) < 2 {
			continue
		}
		pid, err := strconv.Atoi(line[1:])
		if err != nil || pid <= 0 {
			continue
		}
		switch line[0] {
		case '+':
			watched[pid] = true
		case '-':
			delete(watched, pid)
		}
	}
	for pid := range watched {
		syscall.Kill(pid, syscall.SIGKILL)
	}
	// A killed member may still hold files open for a moment; RemoveAll
	// does not mind on Unix.
	os.RemoveAll(dir)
}
