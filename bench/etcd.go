package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

// etcdServer is a one-member etcd cluster embedded in the bench process,
// on loopback ports, with its data in a temporary directory and no fsync.
// Its election timing is etcd's default (heartbeat 100ms, election 1s), so
// the shortest lease TTL it grants is 2s.
type etcdServer struct {
	e   *embed.Etcd
	dir string
	url string // client URL
}

// startEtcd starts the server on two loopback ports found free. Another
// process may take one of them before etcd binds it: then it tries again
// with other ports, a few times.
func startEtcd() (*etcdServer, error) {
	const attempts = 5
	for i := 1; ; i++ {
		s, err := startEtcdOnce()
		if err == nil || i == attempts || !errors.Is(err, syscall.EADDRINUSE) {
			return s, err
		}
	}
}

func startEtcdOnce() (*etcdServer, error) {
	dir, err := os.MkdirTemp("", "leaderbench-etcd-")
	if err != nil {
		return nil, err
	}
	clientPort, err1 := freePort()
	peerPort, err2 := freePort()
	if err := errors.Join(err1, err2); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	cu := url.URL{Scheme: "http", Host: net.JoinHostPort("127.0.0.1", strconv.Itoa(clientPort))}
	pu := url.URL{Scheme: "http", Host: net.JoinHostPort("127.0.0.1", strconv.Itoa(peerPort))}
	cfg := embed.NewConfig()
	cfg.Name = "leaderbench"
	cfg.Dir = filepath.Join(dir, "data")
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{cu}, []url.URL{cu}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{pu}, []url.URL{pu}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	// Like the PostgreSQL cluster (fsync off), etcd does not flush its log
	// to disk: both are measured without the cost of durability.
	cfg.UnsafeNoFsync = true
	cfg.LogLevel = "error"
	cfg.LogOutputs = []string{filepath.Join(dir, "etcd.log")}
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("starting embedded etcd: %w", err)
	}
	select {
	case <-e.Server.ReadyNotify():
	case <-time.After(time.Minute):
		e.Close()
		os.RemoveAll(dir)
		return nil, errors.New("embedded etcd not ready after a minute")
	}
	return &etcdServer{e: e, dir: dir, url: cu.String()}, nil
}

func (s *etcdServer) close() {
	s.e.Close()
	os.RemoveAll(s.dir)
}

// requestsReceived returns the gRPC messages the server has received from
// all its clients (unary requests and stream messages), from its own
// metrics.
func (s *etcdServer) requestsReceived() (int64, error) {
	mfs, err := prometheus.DefaultGatherer.Gather()
	if err != nil {
		return 0, err
	}
	var n float64
	found := false
	for _, mf := range mfs {
		if mf.GetName() != "grpc_server_msg_received_total" {
			continue
		}
		found = true
		for _, m := range mf.GetMetric() {
			n += m.GetCounter().GetValue()
		}
	}
	if !found {
		return 0, errors.New("etcd's grpc_server_msg_received_total metric is not registered")
	}
	return int64(n), nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// holderKeys counts the names held under prefix, an etcd store's key
// prefix: the holder keys (prefix names/<name>/holder) present now.
func (s *etcdServer) holderKeys(ctx context.Context, prefix string) (int64, error) {
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{s.url}, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		return 0, err
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	resp, err := cli.Get(ctx, prefix+"names/", clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		return 0, err
	}
	var n int64
	for _, kv := range resp.Kvs {
		if strings.HasSuffix(string(kv.Key), "/holder") {
			n++
		}
	}
	return n, nil
}
