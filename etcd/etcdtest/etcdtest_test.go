//go:build unix

package etcdtest_test

import (
	"context"
	"errors"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/leaderelect/leader/etcd/etcdtest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// newClient returns a client of endpoints, closed when t ends.
func newClient(t *testing.T, endpoints ...string) *clientv3.Client {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{Endpoints: endpoints, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatalf("etcd client: %v", err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// putEventually puts key=value through cli, each attempt bounded at a
// second and 100ms apart, until one succeeds; it fails t if none has
// after within.
func putEventually(t *testing.T, cli *clientv3.Client, key, value string, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := cli.Put(ctx, key, value)
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("put %s: still failing after %v: %v", key, within, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// wantValue fails t unless key holds value, read linearizably through cli.
func wantValue(t *testing.T, cli *clientv3.Client, key, value string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := cli.Get(ctx, key)
	if err != nil {
		t.Fatalf("get %s: %v", key, err)
	}
	if len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != value {
		t.Fatalf("get %s: got %v, want %q", key, resp.Kvs, value)
	}
}

// timeout returns a context that ends after d, or when t ends.
func timeout(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func TestCluster(t *testing.T) {
	t.Parallel()

	t.Run("a client writes and reads through every member's proxy", func(t *testing.T) {
		t.Parallel()
		c := etcdtest.StartCluster(t, 3)
		writer := newClient(t, c.Endpoints()...)
		putEventually(t, writer, "k", "v", 5*time.Second)
		for i := range 3 {
			wantValue(t, newClient(t, c.Member(i).Endpoint()), "k", "v")
		}
		if got := c.DirectEndpoints(); len(got) != 3 || got[0] == c.Endpoints()[0] {
			t.Errorf("DirectEndpoints() = %v, want 3 URLs other than Endpoints() %v", got, c.Endpoints())
		}
	})

	t.Run("killing the leader elects another, and writes go on", func(t *testing.T) {
		t.Parallel()
		c := etcdtest.StartCluster(t, 3)
		cli := newClient(t, c.Endpoints()...)
		putEventually(t, cli, "k", "before", 5*time.Second)
		old, err := c.LeaderIndex(timeout(t, 5*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		c.Member(old).Kill()
		if c.Member(old).Running() {
			t.Fatalf("member %d runs after Kill", old)
		}
		next, err := c.LeaderIndex(timeout(t, 10*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		if next == old {
			t.Fatalf("leader is still member %d, which was killed", old)
		}
		putEventually(t, cli, "k", "after", 10*time.Second)
		wantValue(t, cli, "k", "after")
	})

	t.Run("losing quorum stops writes, and a restarted member restores it", func(t *testing.T) {
		t.Parallel()
		c := etcdtest.StartCluster(t, 3)
		cli := newClient(t, c.Endpoints()...)
		putEventually(t, cli, "k", "before", 5*time.Second)
		c.Member(1).Stop()
		c.Member(2).Stop()

		const bound = 2 * time.Second
		start := time.Now()
		_, err := cli.Put(timeout(t, bound), "k", "lost")
		// The client's deadline, or the server giving the proposal up
		// first (it may, as the leader steps down without a quorum).
		if !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, rpctypes.ErrTimeout) &&
			!errors.Is(err, rpctypes.ErrTimeoutDueToLeaderFail) && !errors.Is(err, rpctypes.ErrNoLeader) {
			t.Fatalf("put without quorum: got %v, want context.DeadlineExceeded or the server's timeout", err)
		}
		if elapsed := time.Since(start); elapsed > bound+time.Second {
			t.Fatalf("put without quorum took %v, want about %v", elapsed, bound)
		}

		c.Member(1).Restart()
		if err := c.WaitHealthy(timeout(t, 15*time.Second)); err != nil {
			t.Fatal(err)
		}
		putEventually(t, cli, "k", "after", 10*time.Second)
		wantValue(t, cli, "k", "after")
	})

	t.Run("a paused leader is replaced, and rejoins when resumed", func(t *testing.T) {
		t.Parallel()
		c := etcdtest.StartCluster(t, 3)
		old, err := c.LeaderIndex(timeout(t, 5*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		c.Member(old).Pause()
		next, err := c.LeaderIndex(timeout(t, 10*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		if next == old {
			t.Fatalf("leader is still member %d, which is paused", old)
		}
		c.Member(old).Resume()
		if err := c.WaitHealthy(timeout(t, 15*time.Second)); err != nil {
			t.Fatal(err)
		}
		cli := newClient(t, c.Member(old).Endpoint())
		putEventually(t, cli, "k", "resumed", 5*time.Second)
		wantValue(t, cli, "k", "resumed")
	})

	t.Run("a cut client fails fast, and works again when healed", func(t *testing.T) {
		t.Parallel()
		c := etcdtest.StartCluster(t, 3)
		m := c.Member(0)
		cli := newClient(t, m.Endpoint())
		putEventually(t, cli, "k", "before", 5*time.Second)

		m.CutClient()
		// At the TCP level: the connection is reset at once, so soon
		// that the connect itself may fail with the reset.
		start := time.Now()
		conn, err := net.Dial("tcp", hostPort(m.Endpoint()))
		if err == nil {
			conn.SetReadDeadline(time.Now().Add(5 * time.Second))
			_, err = conn.Read(make([]byte, 1))
			conn.Close()
		}
		if err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("read through a cut proxy: got %v, want a reset or end of stream", err)
		}
		if elapsed := time.Since(start); elapsed > time.Second {
			t.Fatalf("read through a cut proxy failed after %v, want at once", elapsed)
		}
		// At the gRPC level, for a call that does not wait for a
		// connection: Unavailable at once.
		start = time.Now()
		err = rawPut(timeout(t, 5*time.Second), m.Endpoint())
		if status.Code(err) != codes.Unavailable {
			t.Fatalf("gRPC put through a cut proxy: got %v, want Unavailable", err)
		}
		if elapsed := time.Since(start); elapsed > time.Second {
			t.Fatalf("gRPC put through a cut proxy failed after %v, want at once", elapsed)
		}
		// etcd's client waits for a connection until its context ends.
		if _, err := cli.Put(timeout(t, time.Second), "k", "cut"); err == nil {
			t.Fatal("put through a cut proxy succeeded")
		}
		// The member still serves its direct clients.
		putEventually(t, newClient(t, m.DirectEndpoint()), "k", "direct", 5*time.Second)

		m.HealClient()
		putEventually(t, cli, "k", "after", 10*time.Second)
		wantValue(t, cli, "k", "after")
	})

	t.Run("a blackholed client hangs, and works again when healed", func(t *testing.T) {
		t.Parallel()
		c := etcdtest.StartCluster(t, 3)
		m := c.Member(2)
		cli := newClient(t, m.Endpoint())
		putEventually(t, cli, "k", "before", 5*time.Second)

		m.BlackholeClient()
		conn, err := net.Dial("tcp", hostPort(m.Endpoint()))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Write([]byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")); err != nil {
			t.Fatalf("write through a blackholed proxy: %v", err)
		}
		conn.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
		_, err = conn.Read(make([]byte, 1))
		conn.Close()
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("read through a blackholed proxy: got %v, want a timeout", err)
		}
		if _, err := cli.Put(timeout(t, time.Second), "k", "blackholed"); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("put through a blackholed proxy: got %v, want context.DeadlineExceeded", err)
		}

		m.HealClient()
		putEventually(t, cli, "k", "after", 10*time.Second)
		wantValue(t, cli, "k", "after")
	})
}

// rawPut sends one Put to the etcd server at endpoint on a new gRPC
// connection, without etcd's client and its retries, failing at once if
// there is no connection.
func rawPut(ctx context.Context, endpoint string) error {
	conn, err := grpc.NewClient(hostPort(endpoint), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	_, err = pb.NewKVClient(conn).Put(ctx, &pb.PutRequest{Key: []byte("raw"), Value: []byte("v")}, grpc.WaitForReady(false))
	return err
}

func hostPort(url string) string {
	return strings.TrimPrefix(url, "http://")
}
