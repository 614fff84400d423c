package pgtest

import (
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"
)

// silence is how long a connection must stay quiet to count as receiving
// nothing.
const silence = 300 * time.Millisecond

// target is a TCP server whose accepted connections the test receives.
type target struct {
	ln       net.Listener
	accepted chan net.Conn
}

func startTarget(t *testing.T) *target {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	tg := &target{ln: ln, accepted: make(chan net.Conn, 10)}
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			tg.accepted <- c
		}
	})
	t.Cleanup(func() {
		ln.Close()
		wg.Wait()
		close(tg.accepted)
		for c := range tg.accepted {
			c.Close()
		}
	})
	return tg
}

// next returns the next connection the target accepted.
func (tg *target) next(t *testing.T) net.Conn {
	t.Helper()
	select {
	case c := <-tg.accepted:
		t.Cleanup(func() { c.Close() })
		return c
	case <-time.After(10 * time.Second):
		t.Fatal("the target accepted no connection within 10s")
		return nil
	}
}

// none checks that the target accepts no connection for a while.
func (tg *target) none(t *testing.T) {
	t.Helper()
	select {
	case c := <-tg.accepted:
		c.Close()
		t.Fatal("a connection reached the target")
	case <-time.After(silence):
	}
}

func startTestProxy(t *testing.T, to string) *proxy {
	t.Helper()
	p, err := startProxy(to)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.close)
	return p
}

func dial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func send(t *testing.T, c net.Conn, s string) {
	t.Helper()
	if _, err := c.Write([]byte(s)); err != nil {
		t.Fatalf("write %q: %v", s, err)
	}
}

// receive reads exactly len(want) bytes and checks them.
func receive(t *testing.T, c net.Conn, want string) {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	got := make([]byte, len(want))
	if _, err := io.ReadFull(c, got); err != nil || string(got) != want {
		t.Fatalf("read %q, %v; want %q", got, err, want)
	}
}

// receiveEnd checks that c's peer closed with a FIN.
func receiveEnd(t *testing.T, c net.Conn) {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := c.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("read %d bytes, %v; want end of stream", n, err)
	}
}

// receiveReset checks that c's peer reset it.
func receiveReset(t *testing.T, c net.Conn) {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := c.Read(make([]byte, 1)); !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("read %d bytes, %v; want a reset", n, err)
	}
}

// receiveNothing checks that nothing arrives on c for a while: no byte, no
// end of stream, no reset.
func receiveNothing(t *testing.T, c net.Conn) {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(silence))
	if n, err := c.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read %d bytes, %v; want nothing until the deadline", n, err)
	}
}

func TestProxy(t *testing.T) {
	t.Parallel()

	t.Run("bytes and the end of stream pass both ways", func(t *testing.T) {
		t.Parallel()
		tg := startTarget(t)
		p := startTestProxy(t, tg.ln.Addr().String())
		client := dial(t, p.addr())
		server := tg.next(t)
		send(t, client, "ping")
		receive(t, server, "ping")
		send(t, server, "pong")
		receive(t, client, "pong")
		_ = client.(*net.TCPConn).CloseWrite()
		receiveEnd(t, server)
		send(t, server, "bye")
		server.Close()
		receive(t, client, "bye")
		receiveEnd(t, client)
	})

	t.Run("a black hole passes nothing, not even a FIN, and holds new connections until healed", func(t *testing.T) {
		t.Parallel()
		tg := startTarget(t)
		p := startTestProxy(t, tg.ln.Addr().String())
		client := dial(t, p.addr())
		server := tg.next(t)

		p.blackHole()
		send(t, client, "up")
		send(t, server, "down")
		_ = server.(*net.TCPConn).CloseWrite()
		late := dial(t, p.addr()) // accepted by the proxy, held there
		send(t, late, "late")
		receiveNothing(t, server)
		receiveNothing(t, client)
		receiveNothing(t, late)
		tg.none(t)

		p.heal()
		receive(t, server, "up")
		receive(t, client, "down")
		receiveEnd(t, client)
		lateServer := tg.next(t)
		receive(t, lateServer, "late")
	})

	t.Run("a cut resets connections, and new ones until healed", func(t *testing.T) {
		t.Parallel()
		tg := startTarget(t)
		p := startTestProxy(t, tg.ln.Addr().String())
		client := dial(t, p.addr())
		server := tg.next(t)

		p.cut()
		receiveReset(t, client)
		receiveReset(t, server)
		// The reset may come before connect returns, or at the first read.
		if refused, err := net.DialTimeout("tcp", p.addr(), 5*time.Second); err == nil {
			receiveReset(t, refused)
			refused.Close()
		} else if !errors.Is(err, syscall.ECONNRESET) {
			t.Fatalf("connecting to the cut proxy: %v; want a reset", err)
		}
		tg.none(t)

		p.heal()
		again := dial(t, p.addr())
		send(t, again, "again")
		receive(t, tg.next(t), "again")
	})

	t.Run("closing resets connections, held ones too", func(t *testing.T) {
		t.Parallel()
		tg := startTarget(t)
		p, err := startProxy(tg.ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		client := dial(t, p.addr())
		server := tg.next(t)
		p.blackHole()
		held := dial(t, p.addr())
		send(t, held, "x")
		receiveNothing(t, held)

		p.close()
		receiveReset(t, client)
		receiveReset(t, server)
		receiveReset(t, held)
		p.heal() // does nothing: a closed proxy stays closed
		if c, err := net.DialTimeout("tcp", p.addr(), time.Second); err == nil {
			c.Close()
			t.Fatal("a closed proxy accepted a connection")
		}
	})
}
