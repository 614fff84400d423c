package main

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc"
)

// counts are what one process sent to its database or etcd, counted by
// the client since the process started.
type counts struct {
	// Statements is the SQL statements sent through pgx (Query, QueryRow,
	// Exec, and each query of a batch), or the etcd requests sent (unary
	// calls and stream messages).
	Statements int64 `json:"statements"`
	// Connects is the connections opened (pgx) or streams opened (etcd).
	Connects int64 `json:"connects"`

	// The scale processes (scaleTracer) also count their statements by
	// kind, and say how many names they lead.
	Renewals int64 `json:"renewals,omitempty"` // the lease store's batched renewals (SQL with unnest()
	Acquires int64 `json:"acquires,omitempty"` // the lease store's acquire statements
	Releases int64 `json:"releases,omitempty"` // the lease store's release statements
	Leading  int64 `json:"leading,omitempty"`  // names this process leads now
	Rounds   int64 `json:"rounds,omitempty"`   // renew rounds in which its Electors renewed
	// The slowest renewal statement (the tracer's start, on a connection
	// already held, to its end) and the slowest Renew call (from the
	// Elector's timer: batching, waiting for a pool connection, the
	// statement) since the previous counts.
	MaxRenewStmtMs float64 `json:"max_renew_stmt_ms,omitempty"`
	MaxRenewCallMs float64 `json:"max_renew_call_ms,omitempty"`
}

// statementCounter is a pgx tracer that counts statements and connects. It
// sees what pgx sends on behalf of the caller; pgx's own pings (a pool's
// liveness check of a connection idle for over a second, a listener's
// keep-alive) go below the tracer and are not counted: the server's
// transaction count shows them.
type statementCounter struct {
	statements atomic.Int64
	connects   atomic.Int64
}

var (
	_ pgx.QueryTracer   = (*statementCounter)(nil)
	_ pgx.BatchTracer   = (*statementCounter)(nil)
	_ pgx.ConnectTracer = (*statementCounter)(nil)
)

func (c *statementCounter) TraceQueryStart(ctx context.Context, conn *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	c.statements.Add(1)
	traceStatement(conn, true, d.SQL, nil)
	return ctx
}

func (c *statementCounter) TraceQueryEnd(_ context.Context, conn *pgx.Conn, d pgx.TraceQueryEndData) {
	traceStatement(conn, false, "", d.Err)
}

func (c *statementCounter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (c *statementCounter) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {
	c.statements.Add(1)
}

func (c *statementCounter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

func (c *statementCounter) TraceConnectStart(ctx context.Context, _ pgx.TraceConnectStartData) context.Context {
	c.connects.Add(1)
	return ctx
}

func (c *statementCounter) TraceConnectEnd(context.Context, pgx.TraceConnectEndData) {}

func (c *statementCounter) snapshot() counts {
	return counts{Statements: c.statements.Load(), Connects: c.connects.Load()}
}

// grpcCounter counts an etcd client's requests: each unary call, and each
// message sent on a stream (lease keep-alives, watch requests), as one
// statement; each stream opened as one connect.
type grpcCounter struct {
	statements atomic.Int64
	streams    atomic.Int64
}

func (c *grpcCounter) dialOptions() []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			c.statements.Add(1)
			return invoker(ctx, method, req, reply, cc, opts...)
		}),
		grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			c.streams.Add(1)
			s, err := streamer(ctx, desc, cc, method, opts...)
			if err != nil {
				return nil, err
			}
			return &countedStream{ClientStream: s, n: &c.statements}, nil
		}),
	}
}

func (c *grpcCounter) snapshot() counts {
	return counts{Statements: c.statements.Load(), Connects: c.streams.Load()}
}

type countedStream struct {
	grpc.ClientStream
	n *atomic.Int64
}

func (s *countedStream) SendMsg(m any) error {
	s.n.Add(1)
	return s.ClientStream.SendMsg(m)
}

// Substrings that tell the lease store's statements apart (see
// postgres/store_sql.go): a round of renewals is one UPDATE ... FROM unnest(...),
// an acquire is an INSERT ... ON CONFLICT in a CTE named granted, a release
// an UPDATE in a CTE named released.
const (
	sqlRenewMark   = "unnest("
	sqlAcquireMark = "granted AS ("
	sqlReleaseMark = "WITH released AS"
)

// scaleTracer is the pgx tracer of a scale process: it counts every
// statement like statementCounter, counts the lease store's statements by
// kind, and times each renewal statement from the tracer's start (the
// query is about to be sent) to its end (its rows have been read and
// closed), calling onRenew.
type scaleTracer struct {
	statementCounter
	renewals, acquires, releases atomic.Int64
	onRenew                      func(start, end time.Time, err error)
}

type renewStartKey struct{}

func (t *scaleTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	t.statements.Add(1)
	switch {
	case strings.Contains(data.SQL, sqlRenewMark):
		t.renewals.Add(1)
		if t.onRenew != nil {
			return context.WithValue(ctx, renewStartKey{}, time.Now())
		}
	case strings.Contains(data.SQL, sqlAcquireMark):
		t.acquires.Add(1)
	case strings.Contains(data.SQL, sqlReleaseMark):
		t.releases.Add(1)
	}
	return ctx
}

func (t *scaleTracer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryEndData) {
	if start, ok := ctx.Value(renewStartKey{}).(time.Time); ok && t.onRenew != nil {
		t.onRenew(start, time.Now(), data.Err)
	}
}

func (t *scaleTracer) snapshot() counts {
	c := t.statementCounter.snapshot()
	c.Renewals, c.Acquires, c.Releases = t.renewals.Load(), t.acquires.Load(), t.releases.Load()
	return c
}

// etcdKeepAliveMethod is the gRPC method of etcd's lease keep-alives.
const etcdKeepAliveMethod = "/etcdserverpb.Lease/LeaseKeepAlive"

// etcdScaleCounter is the request counter of a scale process on the etcd
// store: it counts every request as grpcCounter does, and counts and times
// the lease keep-alives apart, as scaleTracer does the lease store's
// renewal statements. A round of the etcd store's renewals is one
// keep-alive of its shared lease (on a stream opened for it) sent together
// with one read; the keep-alive is timed from its stream's opening to its
// answer, calling onKeepAlive, and counted in Renewals.
type etcdScaleCounter struct {
	grpcCounter
	keepAlives  atomic.Int64
	onKeepAlive func(start, end time.Time, err error)
}

func (c *etcdScaleCounter) dialOptions() []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			c.statements.Add(1)
			return invoker(ctx, method, req, reply, cc, opts...)
		}),
		grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			c.streams.Add(1)
			start := time.Now()
			s, err := streamer(ctx, desc, cc, method, opts...)
			if err != nil {
				return nil, err
			}
			if method != etcdKeepAliveMethod {
				return &countedStream{ClientStream: s, n: &c.statements}, nil
			}
			return &keepAliveStream{ClientStream: s, c: c, start: start}, nil
		}),
	}
}

func (c *etcdScaleCounter) snapshot() counts {
	n := c.grpcCounter.snapshot()
	n.Renewals = c.keepAlives.Load()
	return n
}

// keepAliveStream is a keep-alive stream of etcdScaleCounter's client.
type keepAliveStream struct {
	grpc.ClientStream
	c     *etcdScaleCounter
	start time.Time
	once  sync.Once
}

func (s *keepAliveStream) SendMsg(m any) error {
	s.c.statements.Add(1)
	s.c.keepAlives.Add(1)
	return s.ClientStream.SendMsg(m)
}

func (s *keepAliveStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	s.once.Do(func() {
		if s.c.onKeepAlive != nil {
			s.c.onKeepAlive(s.start, time.Now(), err)
		}
	})
	return err
}
