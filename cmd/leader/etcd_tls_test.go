//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
)

// writePEM writes blocks of type typ to a new file in dir and returns its
// path.
func writePEM(t *testing.T, dir, name, typ string, der []byte) string {
	t.Helper()
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// testCA writes a CA certificate and a server certificate for 127.0.0.1
// that it signed, with the server's key, to dir, and returns the files.
func testCA(t *testing.T, dir string) (caFile, certFile, keyFile string) {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	ca := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "leader test CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	srvKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	srv := &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "127.0.0.1"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(time.Hour),
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
		KeyUsage:    x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	srvDER, err := x509.CreateCertificate(rand.Reader, srv, ca, &srvKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(srvKey)
	if err != nil {
		t.Fatal(err)
	}
	return writePEM(t, dir, "ca.pem", "CERTIFICATE", caDER), writePEM(t, dir, "server.pem", "CERTIFICATE", srvDER),
		writePEM(t, dir, "server-key.pem", "EC PRIVATE KEY", keyDER)
}

// loopbackPort returns a loopback port that was free a moment ago.
func loopbackPort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// TestEtcdStoreOverTLS runs "leader run" and "leader status" on an etcd
// server that serves its clients over TLS only, with an etcds:// store
// URL naming the CA that signed the server's certificate; without it, or
// over plain etcd://, the command fails.
func TestEtcdStoreOverTLS(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	dir := t.TempDir()
	caFile, certFile, keyFile := testCA(t, dir)
	port := loopbackPort(t)
	cu := url.URL{Scheme: "https", Host: net.JoinHostPort("127.0.0.1", strconv.Itoa(port))}
	pu := url.URL{Scheme: "http", Host: net.JoinHostPort("127.0.0.1", strconv.Itoa(loopbackPort(t)))}
	cfg := embed.NewConfig()
	cfg.Name = "tls"
	cfg.Dir = filepath.Join(dir, "data")
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{cu}, []url.URL{cu}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{pu}, []url.URL{pu}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.ClientTLSInfo.CertFile, cfg.ClientTLSInfo.KeyFile = certFile, keyFile
	cfg.UnsafeNoFsync = true
	cfg.LogLevel = "error"
	cfg.LogOutputs = []string{filepath.Join(dir, "etcd.log")}
	srv, err := embed.StartEtcd(cfg)
	if err != nil {
		t.Fatalf("starting etcd over TLS: %v", err)
	}
	t.Cleanup(srv.Close)
	select {
	case <-srv.Server.ReadyNotify():
	case <-time.After(time.Minute):
		t.Fatal("etcd not ready after a minute")
	}
	host := cu.Host
	withCA := "etcds://" + host + "?prefix=tls%2F&cacert=" + url.QueryEscape(caFile)

	r := e.start("run", "--store", withCA, "--name", "tls", "--id", "alpha", "--ttl", "2s", "--", "sleep", "1000")
	defer r.signal(syscall.SIGTERM)
	waitFor(t, 20*time.Second, "status over TLS to show alpha leading", func() bool {
		out, _, code := e.run("status", "--store", withCA, "--name", "tls", "--json")
		var st map[string]any
		return code == 0 && json.Unmarshal([]byte(out), &st) == nil && st["leader"] == "alpha"
	})

	for _, c := range []struct{ what, store string }{
		{"etcds:// without the CA", "etcds://" + host + "?prefix=tls%2F&dial-timeout=2s"},
		{"plain etcd:// to a TLS server", "etcd://" + host + "?prefix=tls%2F&dial-timeout=2s"},
	} {
		if out, stderr, code := e.run("status", "--store", c.store, "--name", "tls", "--json"); code == 0 {
			t.Errorf("status with %s succeeded: %s", c.what, out)
		} else if strings.TrimSpace(stderr) == "" {
			t.Errorf("status with %s failed without saying why", c.what)
		}
	}
}
