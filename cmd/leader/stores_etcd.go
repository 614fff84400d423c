//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/leaderelect/leader/cmd/leader/internal/fence"
	"github.com/leaderelect/leader/etcd"
)

// etcdDialTimeout bounds the first connection to etcd, so that a wrong
// endpoint fails the command instead of hanging it; the URL's dial-timeout
// sets it.
const etcdDialTimeout = 5 * time.Second

// etcdSpec is a parsed etcd:// or etcds:// store URL:
//
//	etcd://[user:password@]host:port[,host:port...][?options]
//	etcds://…   the same, over TLS
//
// with the options prefix (the keys' prefix, default etcd.DefaultPrefix),
// cacert, cert and key (files, as etcdctl's --cacert, --cert and --key;
// etcds:// only), insecure-skip-tls-verify (true or false) and dial-timeout
// (a duration).
type etcdSpec struct {
	endpoints          []string // URLs: http:// or https://, host:port
	user, password     string
	prefix             string
	tls                bool
	cacert, cert, key  string
	insecureSkipVerify bool
	dialTimeout        time.Duration
}

// etcdParams are the query parameters that an etcd store URL may carry.
var etcdParams = []string{"prefix", "cacert", "cert", "key", "insecure-skip-tls-verify", "dial-timeout"}

// parseEtcdURL parses raw, an etcd:// or etcds:// URL, whose masked form
// is display (never quote raw: it may hold a password).
func parseEtcdURL(raw, display string) (etcdSpec, error) {
	bad := func(format string, args ...any) error {
		return usagef("--store %s: %s", display, fmt.Sprintf(format, args...))
	}
	scheme, rest, _ := strings.Cut(raw, "://")
	spec := etcdSpec{tls: strings.EqualFold(scheme, "etcds"), prefix: etcd.DefaultPrefix, dialTimeout: etcdDialTimeout}
	// The authority runs to the first "/" or "?": net/url refuses
	// several hosts, so it is taken apart here.
	authority, tail := rest, ""
	if i := strings.IndexAny(rest, "/?"); i >= 0 {
		authority, tail = rest[:i], rest[i:]
	}
	if i := strings.LastIndex(authority, "@"); i >= 0 {
		userinfo := authority[:i]
		authority = authority[i+1:]
		user, password, ok := strings.Cut(userinfo, ":")
		var err1, err2 error
		spec.user, err1 = url.PathUnescape(user)
		spec.password, err2 = url.PathUnescape(password)
		switch {
		case err1 != nil || err2 != nil:
			return etcdSpec{}, bad("the user or password is not properly escaped")
		case spec.user == "":
			return etcdSpec{}, bad("a password needs a user: etcd://user:password@host:2379")
		case !ok || spec.password == "":
			return etcdSpec{}, bad("user %q has no password: etcd://user:password@host:2379", spec.user)
		}
	}
	if authority == "" {
		return etcdSpec{}, bad("no endpoint: want etcd://host:2379[,host:2379…]")
	}
	httpScheme := "http"
	if spec.tls {
		httpScheme = "https"
	}
	for _, h := range strings.Split(authority, ",") {
		host, port, err := net.SplitHostPort(h)
		if err != nil || host == "" {
			return etcdSpec{}, bad("endpoint %q: want host:port", h)
		}
		if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
			return etcdSpec{}, bad("endpoint %q: the port must be a number from 1 to 65535", h)
		}
		spec.endpoints = append(spec.endpoints, httpScheme+"://"+net.JoinHostPort(host, port))
	}
	path, query, _ := strings.Cut(tail, "?")
	if path != "" && path != "/" {
		return etcdSpec{}, bad("an etcd URL has no path (%q): set the keys' prefix with ?prefix=", path)
	}
	q, err := url.ParseQuery(query)
	if err != nil {
		return etcdSpec{}, bad("the options after '?' are not a valid query: %v", err)
	}
	for k, vs := range q {
		if !slices.Contains(etcdParams, k) {
			return etcdSpec{}, bad("unknown option %q; want one of %s", k, strings.Join(etcdParams, ", "))
		}
		if len(vs) > 1 {
			return etcdSpec{}, bad("option %q is given %d times", k, len(vs))
		}
	}
	if q.Has("prefix") {
		spec.prefix = q.Get("prefix")
	}
	spec.cacert, spec.cert, spec.key = q.Get("cacert"), q.Get("cert"), q.Get("key")
	if v := q.Get("insecure-skip-tls-verify"); v != "" {
		if spec.insecureSkipVerify, err = strconv.ParseBool(v); err != nil {
			return etcdSpec{}, bad("insecure-skip-tls-verify=%q: want true or false", v)
		}
	}
	if v := q.Get("dial-timeout"); v != "" {
		if spec.dialTimeout, err = time.ParseDuration(v); err != nil || spec.dialTimeout <= 0 {
			return etcdSpec{}, bad("dial-timeout=%q: want a positive duration such as 5s", v)
		}
	}
	switch {
	case !spec.tls && (spec.cacert != "" || spec.cert != "" || spec.key != "" || spec.insecureSkipVerify):
		return etcdSpec{}, bad("cacert, cert, key and insecure-skip-tls-verify need TLS: use etcds://")
	case (spec.cert == "") != (spec.key == ""):
		return etcdSpec{}, bad("a client certificate needs both cert and key")
	}
	return spec, nil
}

// tlsConfig returns the TLS configuration of spec, nil without TLS.
func (spec etcdSpec) tlsConfig() (*tls.Config, error) {
	if !spec.tls {
		return nil, nil
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, InsecureSkipVerify: spec.insecureSkipVerify} //nolint:gosec // only when the URL asks for it
	if spec.cacert != "" {
		pem, err := os.ReadFile(spec.cacert)
		if err != nil {
			return nil, fmt.Errorf("reading cacert: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("cacert %s holds no PEM certificate", spec.cacert)
		}
		cfg.RootCAs = pool
	}
	if spec.cert != "" {
		pair, err := tls.LoadX509KeyPair(spec.cert, spec.key)
		if err != nil {
			return nil, fmt.Errorf("loading the client certificate: %w", err)
		}
		cfg.Certificates = []tls.Certificate{pair}
	}
	return cfg, nil
}

// openEtcd connects to the etcd cluster that spec names and opens the
// store on it. It checks that the cluster answers (and, with a user, that
// the credentials are good) before it returns.
func openEtcd(ctx context.Context, spec storeSpec, log *slog.Logger) (*openedStore, error) {
	es := *spec.etcd
	tlsCfg, err := es.tlsConfig()
	if err != nil {
		return nil, fmt.Errorf("opening %s: %w", spec.display, err)
	}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   es.endpoints,
		Username:    es.user,
		Password:    es.password,
		TLS:         tlsCfg,
		DialTimeout: es.dialTimeout,
		// A connection that went silent is found dead within a few
		// seconds, and the client moves to another endpoint.
		DialKeepAliveTime:    2 * time.Second,
		DialKeepAliveTimeout: 2 * time.Second,
		Logger:               zap.NewNop(),
		Context:              context.WithoutCancel(ctx),
	})
	if err != nil {
		return nil, fmt.Errorf("connecting to %s: %w", spec.display, err)
	}
	// clientv3.New dials lazily: a first read says whether the cluster
	// answers and takes the credentials.
	cctx, cancel := context.WithTimeout(ctx, es.dialTimeout)
	_, err = cli.Get(cctx, es.prefix, clientv3.WithCountOnly())
	cancel()
	if err != nil {
		_ = cli.Close()
		return nil, fmt.Errorf("connecting to %s: %w", spec.display, err)
	}
	store, err := etcd.New(cli, etcd.WithPrefix(es.prefix), etcd.WithLogger(log))
	if err != nil {
		_ = cli.Close()
		return nil, fmt.Errorf("opening %s: %w", spec.display, err)
	}
	hosts := slices.Clone(es.endpoints)
	slices.Sort(hosts)
	log.Debug("store opened", slog.String("store", spec.display))
	return &openedStore{
		Store:    store,
		kind:     etcdStore,
		display:  spec.display,
		id:       "etcd:" + strings.Join(hosts, ",") + "/" + es.prefix,
		fenceDir: fence.HostDir(),
		close: func() {
			_ = store.Close()
			_ = cli.Close()
		},
	}, nil
}
