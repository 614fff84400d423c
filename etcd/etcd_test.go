package etcd_test

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/goleak"
	"go.uber.org/zap"
	"google.golang.org/grpc"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/etcd"
	"github.com/leaderelect/leader/leadertest"
)

// endpoint is the client URL of the etcd server that TestMain starts for
// the package's tests.
var endpoint string

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	srv, dir, err := startEtcd()
	if err != nil {
		fmt.Fprintln(os.Stderr, "starting etcd:", err)
		return 1
	}
	endpoint = srv.Config().ListenClientUrls[0].String()
	code := m.Run()
	srv.Close()
	os.RemoveAll(dir)
	if code == 0 {
		if err := goleak.Find(goleakOptions...); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			return 1
		}
	}
	return code
}

// goleakOptions leave out what the embedded server leaves behind after
// Close, which is none of the Store's doing.
var goleakOptions = []goleak.Option{
	goleak.IgnoreAnyFunction("go.opencensus.io/stats/view.(*worker).start"),
	goleak.IgnoreAnyFunction("github.com/golang/glog.(*fileSink).flushDaemon"),
}

// startEtcd starts a one-member etcd server on two loopback ports found
// free, with its data in a temporary directory and no fsync. Its election
// timing (tick 10ms, election 100ms) makes its shortest lease TTL one
// second. Another process may take a port before etcd binds it: then it
// tries again, a few times.
func startEtcd() (*embed.Etcd, string, error) {
	for i := 1; ; i++ {
		e, dir, err := startEtcdOnce()
		if err == nil || i == 5 || !errors.Is(err, syscall.EADDRINUSE) {
			return e, dir, err
		}
	}
}

func startEtcdOnce() (*embed.Etcd, string, error) {
	dir, err := os.MkdirTemp("", "leader-etcd-test-")
	if err != nil {
		return nil, "", err
	}
	cu, pu := loopbackURL(), loopbackURL()
	cfg := embed.NewConfig()
	cfg.Name = "leadertest"
	cfg.Dir = filepath.Join(dir, "data")
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{cu}, []url.URL{cu}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{pu}, []url.URL{pu}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.UnsafeNoFsync = true
	cfg.TickMs, cfg.ElectionMs = 10, 100
	cfg.LogLevel = "error"
	cfg.LogOutputs = []string{filepath.Join(dir, "etcd.log")}
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		os.RemoveAll(dir)
		return nil, "", err
	}
	select {
	case <-e.Server.ReadyNotify():
		return e, dir, nil
	case <-time.After(time.Minute):
		e.Close()
		os.RemoveAll(dir)
		return nil, "", errors.New("embedded etcd not ready after a minute")
	}
}

func loopbackURL() url.URL {
	port := 0
	if l, err := net.Listen("tcp", "127.0.0.1:0"); err == nil {
		port = l.Addr().(*net.TCPAddr).Port
		l.Close()
	}
	return url.URL{Scheme: "http", Host: net.JoinHostPort("127.0.0.1", strconv.Itoa(port))}
}

// counts counts the requests a client sends, by gRPC method.
type counts struct {
	keepAlives atomic.Int64 // LeaseKeepAlive messages sent
	txns       atomic.Int64 // KV Txn requests
	unary      atomic.Int64 // every unary request
}

// newClient returns a client of the test server, closed when t ends; if
// c is not nil, it counts the client's requests.
func newClient(t testing.TB, c *counts) *clientv3.Client {
	t.Helper()
	cfg := clientv3.Config{Endpoints: []string{endpoint}, DialTimeout: 5 * time.Second, Logger: zap.NewNop()}
	if c != nil {
		cfg.DialOptions = []grpc.DialOption{
			grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
				c.unary.Add(1)
				if method == "/etcdserverpb.KV/Txn" {
					c.txns.Add(1)
				}
				return invoker(ctx, method, req, reply, cc, opts...)
			}),
			grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
				cs, err := streamer(ctx, desc, cc, method, opts...)
				if err != nil || method != "/etcdserverpb.Lease/LeaseKeepAlive" {
					return cs, err
				}
				return &countingStream{ClientStream: cs, n: &c.keepAlives}, nil
			}),
		}
	}
	cli, err := clientv3.New(cfg)
	if err != nil {
		t.Fatalf("etcd client: %v", err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

type countingStream struct {
	grpc.ClientStream
	n *atomic.Int64
}

func (s *countingStream) SendMsg(m any) error {
	s.n.Add(1)
	return s.ClientStream.SendMsg(m)
}

// newStore returns a Store on the test server under a prefix of its own,
// closed when t ends.
func newStore(t testing.TB, cli *clientv3.Client, opts ...etcd.Option) *etcd.Store {
	t.Helper()
	opts = append([]etcd.Option{etcd.WithPrefix("test-" + randomHex(6) + "/")}, opts...)
	s, err := etcd.New(cli, opts...)
	if err != nil {
		t.Fatalf("etcd.New: %v", err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = crand.Read(b)
	return hex.EncodeToString(b)
}

func TestConformance(t *testing.T) {
	t.Parallel()
	cli := newClient(t, nil)
	prefix := etcd.WithPrefix("conformance-" + randomHex(6) + "/")
	leadertest.TestStore(t, func(t *testing.T) leader.Store {
		s, err := etcd.New(cli, prefix)
		if err != nil {
			t.Fatalf("etcd.New: %v", err)
		}
		t.Cleanup(func() { s.Close() })
		return s
	})
}
