//go:build unix

package faults_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/Shopify/toxiproxy/v2/stream"
	"github.com/Shopify/toxiproxy/v2/toxics"
	"github.com/rs/zerolog"
)

// In the scenarios of the leader's client link (partition-cut,
// partition-blackhole, client-delay), each candidate's etcd client reaches
// its member through a link of its own: a toxiproxy proxy, in this
// process, from a loopback port to the member's own client port. A fault
// is a set of toxics added to the leader's link; healing replaces the
// proxy with a new one without toxics.

// The toxic types of this package, registered with toxiproxy.
const (
	cutToxicType   = "etcd_faults_cut"
	delayToxicType = "etcd_faults_delay"
)

func init() {
	toxics.Register(cutToxicType, new(cutToxic))
	toxics.Register(delayToxicType, new(delayToxic))
}

// toxic is one toxiproxy toxic, in the JSON form that
// ToxicCollection.AddToxicJson reads.
type toxic struct {
	Name       string         `json:"name"`
	Type       string         `json:"type"`
	Stream     string         `json:"stream"` // "upstream" (to the member) or "downstream"
	Toxicity   float64        `json:"toxicity"`
	Attributes map[string]any `json:"attributes"`
}

// both returns the toxic of type typ with attrs on both streams.
func both(typ string, attrs map[string]any) []toxic {
	return []toxic{
		{Name: typ + "_up", Type: typ, Stream: "upstream", Toxicity: 1, Attributes: attrs},
		{Name: typ + "_down", Type: typ, Stream: "downstream", Toxicity: 1, Attributes: attrs},
	}
}

// linkFault is a fault of a client's link: toxics added in order.
type linkFault struct {
	name   string
	toxics []toxic
}

// clientDelay is the delay fault's latency each way: with the request
// and its answer each delayed this much, no renewal is answered before
// the Elector's local deadline (TTL - DriftMargin after it was sent), as
// in the PostgreSQL delay fault.
const clientDelay = 2500 * time.Millisecond

var (
	// cutLink closes every connection of the link at once and every new
	// one as soon as it is accepted: cutToxic closes each connection's
	// streams; behind it toxiproxy's reset_peer toxic, which receives
	// nothing, makes toxiproxy set SO_LINGER 0 on the connections it
	// accepts from then on, so that those are reset (RST) rather than
	// closed (FIN). toxiproxy's reset_peer alone would act only at a
	// connection's next byte, and leave the goroutine feeding it blocked
	// for good when more than one chunk comes.
	cutLink = linkFault{"cut", append(both(cutToxicType, nil), both("reset_peer", map[string]any{"timeout": 0})...)}
	// blackholeLink keeps every connection, and accepts new ones, but
	// drops every byte both ways, with no FIN and no RST: toxiproxy's
	// timeout toxic with a timeout of 0.
	blackholeLink = linkFault{"blackhole", both("timeout", map[string]any{"timeout": 0})}
	// delayLink delays every byte by clientDelay each way (delayToxic).
	delayLink = linkFault{"delay", both(delayToxicType, map[string]any{"latency": clientDelay.Milliseconds()})}
)

// link is a candidate's own way to one etcd member: a toxiproxy proxy
// from a loopback port to the member's client port. Its proxy is
// replaced by heal, on a port of its own; the candidate's client dials
// whichever is current (dial). Only the test's goroutine may call inject
// and heal.
type link struct {
	server   *toxiproxy.ApiServer
	name     string
	upstream string // the member's host:port
	proxy    *toxiproxy.Proxy
	addr     atomic.Pointer[string] // the current proxy's host:port
}

// newLink starts a link to the member whose own client URL is memberURL,
// stopped when t ends.
func newLink(t *testing.T, server *toxiproxy.ApiServer, name, memberURL string) *link {
	t.Helper()
	l := &link{server: server, name: name, upstream: strings.TrimPrefix(memberURL, "http://")}
	l.start(t)
	t.Cleanup(func() { l.proxy.Stop() })
	return l
}

// start starts a new proxy, without toxics, on a free port of 127.0.0.1,
// and makes it the one the client dials.
func (l *link) start(t *testing.T) {
	t.Helper()
	p := toxiproxy.NewProxy(l.server, l.name, "127.0.0.1:0", l.upstream)
	if err := p.Start(); err != nil {
		t.Fatalf("%s: starting a toxiproxy proxy: %v", l.name, err)
	}
	l.proxy = p
	addr := p.Listen
	l.addr.Store(&addr)
}

// url returns the client URL of the link, which its client is given: its
// dial goes to the current proxy whatever the URL says.
func (l *link) url() string { return "http://" + *l.addr.Load() }

// dial connects to the link's current proxy: the etcd client's dialer.
func (l *link) dial(ctx context.Context, _ string) (net.Conn, error) {
	var d net.Dialer
	return d.DialContext(ctx, "tcp", *l.addr.Load())
}

// inject adds f's toxics to the link: they act on its connections open
// and to come.
func (l *link) inject(t *testing.T, f linkFault) {
	t.Helper()
	for _, tx := range f.toxics {
		js, err := json.Marshal(tx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := l.proxy.Toxics.AddToxicJson(bytes.NewReader(js)); err != nil {
			t.Fatalf("%s: adding toxic %s: %v", l.name, tx.Name, err)
		}
	}
}

// heal ends the link's fault: it starts a new proxy without toxics, on a
// port of its own, which the client dials from then on, and stops the old
// one, which closes every connection through it. (Removing the toxics
// instead can hang in toxiproxy v2.12 once a connection is gone.)
func (l *link) heal(t *testing.T) {
	t.Helper()
	old := l.proxy
	l.start(t)
	old.Stop()
}

// cutToxic ends the stream it is on at once: it closes its output, which
// makes toxiproxy close the connection the stream writes to (and, through
// the other stream, the other one), and it drains its input until the
// stream ends, so that nothing upstream of it ever blocks. It never takes
// an interrupt: toxiproxy then sees its stub closed, and a toxic added
// behind it (reset_peer) is closed at once on the links open, rather than
// started on an input nothing would ever close, its goroutine leaked.
type cutToxic struct{}

// Pipe implements toxics.Toxic.
func (*cutToxic) Pipe(stub *toxics.ToxicStub) {
	stub.Close()
	for range stub.Input {
		// Dropped.
	}
}

// delayToxic delays every chunk of its stream by Latency milliseconds
// from when toxiproxy read it, in order. Unlike toxiproxy's latency toxic
// (v2.12), it never blocks on its output: it goes on reading its input
// while chunks wait, so that a connection closing while chunks are
// delayed leaves no goroutine behind. When the stream ends, the chunks
// still delayed are lost with their connection; when the toxic is
// interrupted (toxics added behind it, or it removed), they are handed on
// at once, each given up after handOnWithin.
type delayToxic struct {
	Latency int64 `json:"latency"`
}

// handOnWithin bounds the wait to hand on each delayed chunk when a
// delayToxic is interrupted.
const handOnWithin = 100 * time.Millisecond

// Pipe implements toxics.Toxic.
func (d *delayToxic) Pipe(stub *toxics.ToxicStub) {
	delay := time.Duration(d.Latency) * time.Millisecond
	var delayed []*stream.StreamChunk
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		var (
			out  chan<- *stream.StreamChunk // set when the first chunk is due
			head *stream.StreamChunk
			due  <-chan time.Time // set while the first chunk waits
		)
		if len(delayed) > 0 {
			if wait := time.Until(delayed[0].Timestamp.Add(delay)); wait > 0 {
				timer.Reset(wait)
				due = timer.C
			} else {
				out, head = stub.Output, delayed[0]
			}
		}
		select {
		case <-stub.Interrupt:
			for _, c := range delayed {
				if stub.WriteOutput(c, handOnWithin) != nil {
					break
				}
			}
			return
		case c := <-stub.Input:
			if c == nil {
				stub.Close()
				return
			}
			delayed = append(delayed, c)
		case out <- head:
			delayed = delayed[1:]
		case <-due:
		}
	}
}

// The faults of a link do what the scenarios say, on connections open and
// new, and heal leaves a link that forwards again: on an echo server, with
// a delay of 200 ms each way rather than clientDelay. Leaked goroutines of
// the toxics would fail TestMain's check.
func TestLinkFaults(t *testing.T) {
	t.Parallel()
	echo := startEcho(t)
	proxies := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())
	l := newLink(t, proxies, "link", "http://"+echo)
	const delay = 200 * time.Millisecond
	shortDelay := linkFault{"delay", both(delayToxicType, map[string]any{"latency": delay.Milliseconds()})}

	for _, f := range []linkFault{cutLink, blackholeLink, shortDelay} {
		open := dialLink(t, l)
		roundTrip(t, open, time.Second)
		l.inject(t, f)
		switch f.name {
		case "cut":
			// The open connection is closed, and a new one fails at its
			// first exchange.
			if err := readFails(open, time.Second); err != nil {
				t.Errorf("cut: the connection open: %v", err)
			}
			if err := newConnCut(t.Context(), l, time.Second); err != nil {
				t.Errorf("cut: a new connection: %v", err)
			}
		case "blackhole":
			for _, c := range []net.Conn{open, dialLink(t, l)} {
				if _, err := c.Write([]byte("ping")); err != nil {
					t.Fatalf("blackhole: write: %v", err)
				}
				_ = c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
				if _, err := c.Read(make([]byte, 4)); !errors.Is(err, os.ErrDeadlineExceeded) {
					t.Errorf("blackhole: read: %v; want no answer and no end", err)
				}
			}
		case "delay":
			for _, c := range []net.Conn{open, dialLink(t, l)} {
				if took := roundTrip(t, c, 10*delay); took < 2*delay {
					t.Errorf("delay: a round trip took %v; want at least %v", took, 2*delay)
				}
			}
		}
		l.heal(t)
		roundTrip(t, dialLink(t, l), time.Second)
	}
}

// startEcho starts a TCP server on 127.0.0.1 that sends back what it
// reads, stopped when t ends, and returns its address.
func startEcho(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Go(func() { _, _ = io.Copy(c, c) })
		}
	})
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return ln.Addr().String()
}

// dialLink opens a connection through l, closed when t ends. A connect
// to a proxy on a port that was in use moments before (by a proxy or
// server of an earlier run of the test, with -count) is now and then
// reset, for some milliseconds; that is not what the test is about: it
// tries again, for a second at most.
func dialLink(t *testing.T, l *link) net.Conn {
	t.Helper()
	for attempt := 1; ; attempt++ {
		c, err := l.dial(t.Context(), "")
		if errors.Is(err, syscall.ECONNRESET) && attempt < 20 {
			time.Sleep(50 * time.Millisecond)
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
}

// roundTrip sends "ping" on c and reads it back within limit, and returns
// how long that took.
func roundTrip(t *testing.T, c net.Conn, limit time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatalf("write: %v", err)
	}
	_ = c.SetReadDeadline(start.Add(limit))
	buf := make([]byte, 4)
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "ping" {
		t.Fatalf("read back %q: %v", buf, err)
	}
	return time.Since(start)
}

// newConnCut opens a connection through l, writes on it and reads from
// it, and returns nil if it is reset or ended: reset as soon as toxiproxy
// accepts it, it may fail at its connect or its write already, but only
// with a reset or an end of stream; or the read fails within limit (see
// readFails). It returns an error saying what happened otherwise.
func newConnCut(ctx context.Context, l *link, limit time.Duration) error {
	resetOrEOF := func(what string, err error) error {
		if errors.Is(err, syscall.ECONNRESET) || errors.Is(err, io.EOF) {
			return nil
		}
		return fmt.Errorf("%s: %w; want a reset or an end of stream", what, err)
	}
	c, err := l.dial(ctx, "")
	if err != nil {
		return resetOrEOF("connect", err)
	}
	defer c.Close()
	if _, err := c.Write([]byte("ping")); err != nil {
		return resetOrEOF("write", err)
	}
	return readFails(c, limit)
}

// readFails returns nil if a read from c fails (an end of stream or a
// reset) within limit, and an error saying what happened otherwise.
func readFails(c net.Conn, limit time.Duration) error {
	_ = c.SetReadDeadline(time.Now().Add(limit))
	n, err := c.Read(make([]byte, 4))
	switch {
	case errors.Is(err, os.ErrDeadlineExceeded):
		return fmt.Errorf("still open after %v", limit)
	case err == nil:
		return fmt.Errorf("read %d bytes; want the connection ended", n)
	}
	return nil
}
