//go:build unix

package etcdtest

import (
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// proxyMode is what a proxy does with the connections it accepts.
type proxyMode int

const (
	forwarding  proxyMode = iota // forward both ways
	cut                          // reset at once
	blackholing                  // keep open, read and drop, send nothing
)

// proxyDialTimeout bounds the dial of the member for a new connection; on
// loopback a refused dial fails at once, so this only matters for a
// stopped (SIGSTOP) member whose listen backlog is full.
const proxyDialTimeout = 2 * time.Second

// proxy is a TCP forwarder from a loopback port of its own to a member's
// client port. It is hand-made rather than toxiproxy's, so that the tests
// of other modules that start clusters (cmd/leader's) need nothing more
// than etcdtest; etcd/faults puts toxiproxy proxies of its own in front
// of the members for the faults of a client's link. Its port stays the
// same for its lifetime, across restarts of the member.
type proxy struct {
	ln       net.Listener
	url      string // http://127.0.0.1:port of ln
	upstream string // host:port of the member

	wg sync.WaitGroup // serve, and each connection's goroutines

	mu     sync.Mutex
	mode   proxyMode
	links  map[*link]struct{}
	closed bool
}

// link is one client connection, with the member connection it is
// forwarded to.
type link struct {
	client   net.Conn
	upstream net.Conn // nil if accepted while blackholing

	// dropping is set when the proxy starts blackholing: from then on,
	// what the client sends is read and dropped, and upstream is closed.
	dropping atomic.Bool
}

// startProxy starts a proxy to the member at upstream (host:port) on a
// free port of 127.0.0.1.
func startProxy(upstream string) (*proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &proxy{
		ln:       ln,
		url:      "http://" + ln.Addr().String(),
		upstream: upstream,
		links:    make(map[*link]struct{}),
	}
	p.wg.Add(1)
	go p.serve()
	return p, nil
}

func (p *proxy) serve() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of file descriptors, say: wait, as net/http does.
			time.Sleep(10 * time.Millisecond)
			continue
		}
		p.wg.Add(1)
		go p.handle(c)
	}
}

// handle forwards one client connection, or resets or blackholes it as
// the mode says, until either side closes it or the mode changes.
func (p *proxy) handle(c net.Conn) {
	defer p.wg.Done()
	p.mu.Lock()
	mode, closed := p.mode, p.closed
	p.mu.Unlock()
	if closed || mode == cut {
		reset(c)
		return
	}
	l := &link{client: c}
	if mode == forwarding {
		up, err := net.DialTimeout("tcp", p.upstream, proxyDialTimeout)
		if err != nil {
			// The member is down: the client sees it as if refused.
			reset(c)
			return
		}
		l.upstream = up
	}

	// The mode may have changed during the dial.
	p.mu.Lock()
	switch {
	case p.closed || p.mode == cut:
		p.mu.Unlock()
		l.close(true)
		return
	case p.mode == blackholing || l.upstream == nil:
		l.blackhole()
	}
	p.links[l] = struct{}{}
	p.mu.Unlock()

	if l.upstream != nil {
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			l.copyBack()
		}()
	}
	l.copyForward()

	p.mu.Lock()
	delete(p.links, l)
	p.mu.Unlock()
}

// copyForward copies from the client to the member until the client's
// side fails or closes, then closes both.
func (l *link) copyForward() {
	buf := make([]byte, 32<<10)
	for {
		n, err := l.client.Read(buf)
		if n > 0 && !l.dropping.Load() {
			if _, werr := l.upstream.Write(buf[:n]); werr != nil && !l.dropping.Load() {
				l.close(false)
				return
			}
		}
		if err != nil {
			l.close(false)
			return
		}
	}
}

// copyBack copies from the member to the client until the member's side
// fails or closes, then closes both, unless the link is dropping: then
// copyForward keeps the client's side open.
func (l *link) copyBack() {
	buf := make([]byte, 32<<10)
	for {
		n, err := l.upstream.Read(buf)
		if n > 0 && !l.dropping.Load() {
			if _, werr := l.client.Write(buf[:n]); werr != nil {
				l.close(false)
				return
			}
		}
		if err != nil {
			if !l.dropping.Load() {
				l.close(false)
			}
			return
		}
	}
}

// blackhole makes the link drop what the client sends and closes its
// member side.
func (l *link) blackhole() {
	l.dropping.Store(true)
	if l.upstream != nil {
		l.upstream.Close()
	}
}

// close closes both sides; with rst, the client's side with a reset
// rather than an orderly close.
func (l *link) close(rst bool) {
	if rst {
		reset(l.client)
	} else {
		l.client.Close()
	}
	if l.upstream != nil {
		l.upstream.Close()
	}
}

// reset closes c with a TCP reset, so that the peer fails at once rather
// than reading an orderly end of stream.
func reset(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetLinger(0)
	}
	c.Close()
}

// cut resets every connection, and every new one as soon as it is
// accepted, until heal.
func (p *proxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.mode = cut
	for l := range p.links {
		l.close(true)
	}
}

// blackhole keeps every connection, and every new one, open, but forwards
// nothing either way until heal; it closes the connections to the member.
func (p *proxy) blackhole() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.mode = blackholing
	for l := range p.links {
		l.blackhole()
	}
}

// heal forwards new connections again, and closes the blackholed ones so
// that their clients connect anew.
func (p *proxy) heal() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.mode = forwarding
	for l := range p.links {
		if l.dropping.Load() {
			l.close(false)
		}
	}
}

// close stops the proxy: it closes its listener and every connection, and
// waits for its goroutines to end.
func (p *proxy) close() {
	p.mu.Lock()
	p.closed = true
	p.ln.Close()
	for l := range p.links {
		l.close(false)
	}
	p.mu.Unlock()
	p.wg.Wait()
}
