package pgtest

import (
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"
)

// proxy forwards TCP connections from a port of 127.0.0.1 to a target
// address, and breaks them as a network would, on demand:
//
//   - heal: bytes pass both ways, and so do end of stream (FIN) and resets;
//   - black hole: nothing passes, neither bytes nor FIN nor RST, and the
//     connections stay open, as when a host or a link vanishes. New
//     connections are accepted and held likewise: they are dialed through
//     once healed. What is held is delivered on heal, as TCP retransmits
//     after a partition ends; what the peers did meanwhile (a timeout, a
//     close) decides whether the connection survives;
//   - cut: every connection is reset (RST to both peers) and a new one is
//     reset as soon as it is accepted, as when a firewall rejects the
//     traffic.
//
// (toxiproxy's timeout toxic drops the bytes instead, which corrupts a
// stream that carries on after the fault; its reset_peer toxic acts only
// at a connection's next byte; and removing a toxic can hang in v2.12.)
//
// Bytes a pump has already handed to the kernel when BlackHole or Cut is
// called may still arrive: they were on the wire. Nothing read after the
// call is passed on.
type proxy struct {
	ln     net.Listener
	target string

	mu      sync.Mutex
	state   linkState
	changed chan struct{} // closed, and replaced, at each change of state
	cuts    int           // Cut calls so far
	conns   map[*net.TCPConn]struct{}

	wg sync.WaitGroup // the accept loop and each connection's goroutines
}

// linkState is what a proxy does to its connections.
type linkState int

const (
	passing linkState = iota
	blackHoled
	cut
	closed
)

// dialTimeout bounds the proxy's connection to its target.
const dialTimeout = 10 * time.Second

// startProxy starts a proxy to target on a free port of 127.0.0.1.
func startProxy(target string) (*proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("pgtest: proxy to %s: %w", target, err)
	}
	p := &proxy{ln: ln, target: target, changed: make(chan struct{}), conns: map[*net.TCPConn]struct{}{}}
	p.wg.Add(1)
	go p.acceptLoop()
	return p, nil
}

// addr returns the address clients connect to, "127.0.0.1:port".
func (p *proxy) addr() string { return p.ln.Addr().String() }

// heal lets bytes through again, held ones first.
func (p *proxy) heal() { p.setState(passing) }

// blackHole stops every byte, FIN and RST, and holds new connections.
func (p *proxy) blackHole() { p.setState(blackHoled) }

// cut resets every connection, and those accepted until heal.
func (p *proxy) cut() { p.setState(cut) }

// close stops accepting, resets every connection and waits for the
// proxy's goroutines to end. Later calls do nothing.
func (p *proxy) close() {
	p.setState(closed)
	p.ln.Close()
	p.wg.Wait()
}

// setState changes the state, wakes the goroutines waiting on it and, for
// cut and closed, resets every connection. A closed proxy stays closed.
func (p *proxy) setState(s linkState) {
	p.mu.Lock()
	if p.state == closed {
		p.mu.Unlock()
		return
	}
	p.state = s
	if s == cut {
		p.cuts++
	}
	close(p.changed)
	p.changed = make(chan struct{})
	var doomed []*net.TCPConn
	if s == cut || s == closed {
		for c := range p.conns {
			doomed = append(doomed, c)
		}
	}
	p.mu.Unlock()
	for _, c := range doomed {
		reset(c)
	}
}

// waitPassing waits while the proxy is black-holed. It reports whether
// bytes may pass: false once the proxy is cut or closed, which has reset
// the connections.
func (p *proxy) waitPassing() bool {
	for {
		p.mu.Lock()
		s, changed := p.state, p.changed
		p.mu.Unlock()
		switch s {
		case passing:
			return true
		case blackHoled:
			<-changed
		default:
			return false
		}
	}
}

func (p *proxy) acceptLoop() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return // closed
		}
		p.wg.Add(1)
		go p.serve(c.(*net.TCPConn))
	}
}

// serve forwards one client connection: once bytes may pass, it dials the
// target and pumps both ways until both are done.
func (p *proxy) serve(client *net.TCPConn) {
	defer p.wg.Done()
	cuts, ok := p.track(client, -1)
	if !ok {
		reset(client)
		return
	}
	defer p.untrack(client)
	if !p.waitPassing() {
		reset(client)
		return
	}
	d := net.Dialer{Timeout: dialTimeout}
	c, err := d.Dial("tcp", p.target)
	if err != nil {
		reset(client) // as a refused connection would
		return
	}
	server := c.(*net.TCPConn)
	// A cut while dialing reset the client; the server must go too.
	if _, ok := p.track(server, cuts); !ok {
		reset(server)
		reset(client)
		return
	}
	defer p.untrack(server)
	var pumps sync.WaitGroup
	pumps.Go(func() { p.pump(client, server) })
	pumps.Go(func() { p.pump(server, client) })
	pumps.Wait()
	client.Close()
	server.Close()
}

// track registers c, to be reset by cut and close. It refuses when the
// proxy is cut or closed, or, if cuts is not -1, when it has been cut
// since cuts was returned. It returns the number of cuts so far.
func (p *proxy) track(c *net.TCPConn, cuts int) (int, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.state == cut || p.state == closed || (cuts >= 0 && cuts != p.cuts) {
		return p.cuts, false
	}
	p.conns[c] = struct{}{}
	return p.cuts, true
}

func (p *proxy) untrack(c *net.TCPConn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.conns, c)
}

// pump copies src to dst, each chunk once bytes may pass. The end of src
// is passed on as a FIN (half-close), a failure of either side as a reset
// of both.
func (p *proxy) pump(src, dst *net.TCPConn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if !p.waitPassing() {
				return
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				reset(src)
				reset(dst)
				return
			}
		}
		if err != nil {
			if !p.waitPassing() {
				return
			}
			if errors.Is(err, io.EOF) {
				_ = dst.CloseWrite()
			} else {
				reset(src)
				reset(dst)
			}
			return
		}
	}
}

// reset closes c with an RST rather than a FIN.
func reset(c *net.TCPConn) {
	_ = c.SetLinger(0)
	_ = c.Close()
}
