package postgres

import (
	"cmp"
	"context"
	"errors"
	"net"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// dialer opens the connections of a store (or Router) of its own that are
// not from its pool: the wake-up listener's, and an AdvisoryStore's
// sessions and lock waiters. Its configuration is the caller's pool's,
// with a connect timeout per host (see ownConnConfig), and it tries the
// hosts of a multi-host connection string in the order of hosts, which
// the store's own pool shares.
type dialer struct {
	config *pgx.ConnConfig
	hosts  *hostOrder
}

// newDialer returns a dialer on pool's configuration, with a host order
// of its own.
func newDialer(pool *pgxpool.Pool) dialer {
	return dialer{config: ownConnConfig(pool), hosts: new(hostOrder)}
}

// ownConnConfig returns the configuration of a store's own connections:
// pool's, with DefaultConnectTimeout per host if it sets none (pgx's
// default is none: a host that never answers would hold every attempt).
func ownConnConfig(pool *pgxpool.Pool) *pgx.ConnConfig {
	config := pool.Config().ConnConfig // a copy
	if config.ConnectTimeout == 0 {
		config.ConnectTimeout = DefaultConnectTimeout
	}
	return config
}

// connConfig returns a copy of d's configuration for one new connection,
// its hosts in the order of d.hosts.
func (d dialer) connConfig() *pgx.ConnConfig {
	config := d.config.Copy()
	d.hosts.order(&config.Config)
	return config
}

// within returns how long opening one connection may take: pgx tries the
// hosts of a multi-host connection string in turn, each for the connect
// timeout, so a host that never answers must not use up the time of the
// hosts after it.
func (d dialer) within() time.Duration {
	return time.Duration(1+len(d.config.Fallbacks)) * d.config.ConnectTimeout
}

// connect opens a connection with config (from connConfig), within
// d.within() of ctx.
func (d dialer) connect(ctx context.Context, config *pgx.ConnConfig) (*pgx.Conn, error) {
	ctx, cancel := context.WithTimeout(ctx, d.within())
	defer cancel()
	return pgx.ConnectConfig(ctx, config)
}

// hostOrder is the order in which a store's new connections try the hosts
// of a multi-host connection string (see Failover in the package
// documentation). pgx tries them in turn, each for the connect timeout; a
// host listed first that has vanished, its packets dropped, would cost
// every new connection that timeout, for as long as the connection string
// lists it. So the hosts are tried by how each did last: first those that
// answered as a primary (or were never tried), in the configuration's
// order; then those that answered but were refused or are standbys (a
// round trip each); last those that did not answer in time, or on which a
// call of the store's was cut short or a connection broke (see
// hostAttempt). A host moves back to the front once it answers as a
// primary again, which a host tried last does when all the others fail.
//
// A single-host configuration is left alone. The zero value is ready to
// use, and its methods are safe for concurrent use.
type hostOrder struct {
	mu       sync.Mutex
	standing map[hostKey]standing
}

// hostKey names a host of a configuration: its host (name, address or
// Unix socket directory) and port, as the connection string gives them.
type hostKey struct {
	host string
	port uint16
}

func keyOf(fb *pgconn.FallbackConfig) hostKey { return hostKey{fb.Host, fb.Port} }

// standing is how a host did the last time the store tried it; hosts are
// tried in its order.
type standing uint8

const (
	// hostFine answered as a primary, or was never tried.
	hostFine standing = iota
	// hostRefused answered, but as a standby, or was refused by
	// target_session_attrs.
	hostRefused
	// hostSilent did not answer in time or could not be reached, or a
	// connection of the store's to it broke.
	hostSilent
)

// set records how host did.
func (o *hostOrder) set(host hostKey, s standing) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.standing == nil {
		o.standing = make(map[hostKey]standing)
	}
	o.standing[host] = s
}

// order reorders config's hosts (its own and its Fallbacks) by their
// standing, keeping the configuration's order among equals (so the
// entries of one host, such as sslmode=prefer's with and without TLS,
// stay together and in order), and has config report to o how each host
// that the connection tries does. config must be a copy of its own.
func (o *hostOrder) order(config *pgconn.Config) {
	hosts := append([]*pgconn.FallbackConfig{{Host: config.Host, Port: config.Port, TLSConfig: config.TLSConfig}}, config.Fallbacks...)
	if !slices.ContainsFunc(hosts, func(fb *pgconn.FallbackConfig) bool { return keyOf(fb) != keyOf(hosts[0]) }) {
		return // one host
	}
	o.mu.Lock()
	slices.SortStableFunc(hosts, func(a, b *pgconn.FallbackConfig) int {
		return cmp.Compare(o.standing[keyOf(a)], o.standing[keyOf(b)])
	})
	o.mu.Unlock()
	config.Host, config.Port, config.TLSConfig = hosts[0].Host, hosts[0].Port, hosts[0].TLSConfig
	config.Fallbacks = hosts[1:]
	a := &hostAttempt{order: o, hosts: hosts, addrs: make(map[string]hostKey)}
	a.follow(config)
}

// beforeConnect returns a pgxpool BeforeConnect hook that runs next (the
// caller's, if any), then orders the new connection's hosts.
func (o *hostOrder) beforeConnect(next func(context.Context, *pgx.ConnConfig) error) func(context.Context, *pgx.ConnConfig) error {
	return func(ctx context.Context, config *pgx.ConnConfig) error {
		if next != nil {
			if err := next(ctx, config); err != nil {
				return err
			}
		}
		o.order(&config.Config)
		return nil
	}
}

// hostAttempt follows one connection's attempt through its
// configuration's hosts, and tells its hostOrder how each did. pgx looks
// up the hosts in order, then dials their addresses in order until a
// server accepts the connection: a host whose address it dials after
// another's failed. Once connected, the connection dials its server again
// only to cancel a statement: a call on it was cut short, or it broke
// (pgx closes a connection that fails, and sends a cancel request as it
// does), and its host then goes last.
type hostAttempt struct {
	order *hostOrder
	hosts []*pgconn.FallbackConfig // in the order tried

	mu      sync.Mutex         // cancel requests dial from other goroutines
	lookups int                // how many hosts were looked up
	addrs   map[string]hostKey // the host of each address to dial
	dialed  map[string]bool    // the addresses dialed to connect
	last    *hostKey           // the host dialed last; nil before the first dial
	refused bool               // the last host dialed was refused
	at      *hostKey           // the host connected to; nil before
}

// follow installs a's hooks in config, around its own.
func (a *hostAttempt) follow(config *pgconn.Config) {
	lookup, dial, validate, after := config.LookupFunc, config.DialFunc, config.ValidateConnect, config.AfterConnect
	if lookup == nil || dial == nil {
		return
	}
	for _, fb := range a.hosts {
		if network, addr := pgconn.NetworkAddress(fb.Host, fb.Port); network == "unix" {
			a.addrs[addr] = keyOf(fb) // not looked up
		}
	}
	config.LookupFunc = func(ctx context.Context, host string) ([]string, error) {
		addrs, err := lookup(ctx, host)
		a.lookedUp(host, addrs)
		return addrs, err
	}
	config.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		own := a.dialing(addr)
		conn, err := dial(ctx, network, addr)
		if err != nil && own {
			a.failed(addr)
		}
		return conn, err
	}
	if validate != nil {
		config.ValidateConnect = func(ctx context.Context, conn *pgconn.PgConn) error {
			err := validate(ctx, conn)
			if err != nil {
				a.refusedBy(conn, err)
			}
			return err
		}
	}
	config.AfterConnect = func(ctx context.Context, conn *pgconn.PgConn) error {
		if after != nil {
			if err := after(ctx, conn); err != nil {
				return err
			}
		}
		a.connected(conn)
		return nil
	}
}

// lookedUp records the addresses that the lookup of host gave: pgx looks
// up the hosts that are not Unix sockets one by one, in order. An address
// may name its own port, as pgx allows.
func (a *hostAttempt) lookedUp(host string, addrs []string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	var fb *pgconn.FallbackConfig
	for ; a.lookups < len(a.hosts) && fb == nil; a.lookups++ {
		if network, _ := pgconn.NetworkAddress(a.hosts[a.lookups].Host, 0); network != "unix" {
			fb = a.hosts[a.lookups]
		}
	}
	if fb == nil || fb.Host != host {
		return
	}
	for _, ip := range addrs {
		port := fb.Port
		if h, p, err := net.SplitHostPort(ip); err == nil {
			if n, err := strconv.ParseUint(p, 10, 16); err == nil {
				ip, port = h, uint16(n)
			}
		}
		_, addr := pgconn.NetworkAddress(ip, port)
		if _, ok := a.addrs[addr]; !ok {
			a.addrs[addr] = keyOf(fb)
		}
	}
}

// dialing records that addr is about to be dialed, and reports whether
// the dial is one to connect (not a cancel request, nor pgx's second try
// of an address, as sslmode=prefer's without TLS). Moving on from
// another host means that host failed: it did not answer in time, or
// could not serve, unless it was refused (see refusedBy).
func (a *hostAttempt) dialing(addr string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	host, ok := a.addrs[addr]
	switch {
	case a.at != nil:
		if ok && host == *a.at { // the connection's cancel request
			a.order.set(host, hostSilent)
		}
		return false
	case a.dialed[addr]:
		return false
	}
	if a.dialed == nil {
		a.dialed = make(map[string]bool)
	}
	a.dialed[addr] = true
	if a.last != nil && (!ok || host != *a.last) {
		if !a.refused {
			a.order.set(*a.last, hostSilent)
		}
		a.refused = false
	}
	a.last = nil
	if ok {
		a.last = &host
	}
	return true
}

// failed records that dialing addr failed.
func (a *hostAttempt) failed(addr string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if host, ok := a.addrs[addr]; ok {
		a.order.set(host, hostSilent)
	}
}

// refusedBy records that the server of conn was refused by
// target_session_attrs (ValidateConnect) with err: it is a standby, say,
// or did not answer the check in time.
func (a *hostAttempt) refusedBy(conn *pgconn.PgConn, err error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	host, ok := a.hostOf(conn)
	if !ok {
		return
	}
	s := hostRefused
	if pgconn.Timeout(err) || errors.Is(err, context.DeadlineExceeded) {
		s = hostSilent
	}
	a.order.set(host, s)
	a.refused = true
}

// connected records that the attempt connected to the server of conn: it
// answered as a primary, or, if it reports itself in hot standby
// (PostgreSQL 14 and later), as a standby.
func (a *hostAttempt) connected(conn *pgconn.PgConn) {
	a.mu.Lock()
	defer a.mu.Unlock()
	host, ok := a.hostOf(conn)
	if !ok {
		return
	}
	a.at = &host
	s := hostFine
	if conn.ParameterStatus("in_hot_standby") == "on" {
		s = hostRefused
	}
	a.order.set(host, s)
}

// hostOf returns the host of conn's server: by its address, or (a Unix
// socket's is not the one dialed) the host dialed last. The caller holds
// a.mu.
func (a *hostAttempt) hostOf(conn *pgconn.PgConn) (hostKey, bool) {
	if host, ok := a.addrs[conn.Conn().RemoteAddr().String()]; ok {
		return host, true
	}
	if a.last != nil {
		return *a.last, true
	}
	return hostKey{}, false
}
