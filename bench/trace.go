package main

import (
	"context"
	"sync/atomic"

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

func (c *statementCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.statements.Add(1)
	return ctx
}

func (c *statementCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

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
