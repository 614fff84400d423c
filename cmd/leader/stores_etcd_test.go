//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/leaderelect/leader/cmd/leader/internal/redact"
)

// TestParseEtcdURL checks the etcd store URLs that the command takes, and
// that each one it refuses is refused with a message naming what is wrong,
// with the password masked.
func TestParseEtcdURL(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		url  string
		want etcdSpec
	}{
		{"etcd://127.0.0.1:2379", etcdSpec{endpoints: []string{"http://127.0.0.1:2379"}, prefix: "leader/", dialTimeout: etcdDialTimeout}},
		{"etcd://a:2379,b:2380/", etcdSpec{endpoints: []string{"http://a:2379", "http://b:2380"}, prefix: "leader/", dialTimeout: etcdDialTimeout}},
		{"etcd://[::1]:2379?prefix=apps/x/&dial-timeout=2s", etcdSpec{endpoints: []string{"http://[::1]:2379"}, prefix: "apps/x/", dialTimeout: 2 * time.Second}},
		{"etcd://root:s%40cret:x@h:2379", etcdSpec{endpoints: []string{"http://h:2379"}, user: "root", password: "s@cret:x", prefix: "leader/", dialTimeout: etcdDialTimeout}},
		{"etcds://h:2379?cacert=/ca.pem&cert=/c.pem&key=/k.pem", etcdSpec{endpoints: []string{"https://h:2379"}, tls: true, cacert: "/ca.pem", cert: "/c.pem", key: "/k.pem", prefix: "leader/", dialTimeout: etcdDialTimeout}},
		{"ETCDS://h:2379?insecure-skip-tls-verify=true", etcdSpec{endpoints: []string{"https://h:2379"}, tls: true, insecureSkipVerify: true, prefix: "leader/", dialTimeout: etcdDialTimeout}},
	} {
		spec, err := parseStoreURL(c.url)
		if err != nil {
			t.Errorf("parseStoreURL(%q): %v", c.url, err)
			continue
		}
		if spec.kind != etcdStore || spec.etcd == nil {
			t.Errorf("parseStoreURL(%q) = kind %v; want an etcd store", c.url, spec.kind)
			continue
		}
		got := *spec.etcd
		if !slices.Equal(got.endpoints, c.want.endpoints) {
			t.Errorf("parseStoreURL(%q) endpoints %q; want %q", c.url, got.endpoints, c.want.endpoints)
		}
		got.endpoints, c.want.endpoints = nil, nil
		if !reflect.DeepEqual(got, c.want) {
			t.Errorf("parseStoreURL(%q) = %+v; want %+v", c.url, got, c.want)
		}
	}

	for _, c := range []struct{ url, says string }{
		{"etcd://", "no endpoint"},
		{"etcd://h", `endpoint "h": want host:port`},
		{"etcd://h:x", "the port must be a number"},
		{"etcd://h:2379,", `endpoint "": want host:port`},
		{"etcd://h:2379/leader", "has no path"},
		{"etcd://h:2379?prefx=a", `unknown option "prefx"`},
		{"etcd://h:2379?prefix=a&prefix=b", `option "prefix" is given 2 times`},
		{"etcd://h:2379?cacert=/ca.pem", "need TLS: use etcds://"},
		{"etcds://h:2379?cert=/c.pem", "needs both cert and key"},
		{"etcds://h:2379?insecure-skip-tls-verify=maybe", "want true or false"},
		{"etcd://h:2379?dial-timeout=-1s", "want a positive duration"},
		{"etcd://root@h:2379", `user "root" has no password`},
		{"etcd://:hunter22@h:2379", "a password needs a user"},
	} {
		_, err := parseStoreURL(c.url)
		if err == nil {
			t.Errorf("parseStoreURL(%q) accepted it; want an error saying %q", c.url, c.says)
			continue
		}
		if !strings.Contains(err.Error(), c.says) {
			t.Errorf("parseStoreURL(%q) = %q; want it to say %q", c.url, err, c.says)
		}
		if strings.Contains(err.Error(), "hunter22") {
			t.Errorf("parseStoreURL(%q) = %q: shows the password", c.url, err)
		}
	}
}

// TestEtcdURLPasswordsAreMasked checks that an etcd URL with several
// endpoints, which net/url refuses, is shown with its password masked, and
// that the password is masked in the text of logs and errors.
func TestEtcdURLPasswordsAreMasked(t *testing.T) {
	t.Parallel()
	for _, raw := range []string{
		"etcd://root:hunter22@h1:2379,h2:2379?prefix=x/",
		"etcds://root:hunter22@h1:2379",
		"etcd://root:hunter22@h1:2379,h2:2379/extra",
	} {
		got := redact.URL(raw)
		if strings.Contains(got, "hunter22") || !strings.Contains(got, redact.Mask) {
			t.Errorf("redact.URL(%q) = %q; want the password masked", raw, got)
		}
		if got := redact.ForURL(raw).String("auth failed for root:hunter22"); strings.Contains(got, "hunter22") {
			t.Errorf("the Redactor for %q leaves the password in %q", raw, got)
		}
		if _, err := parseStoreURL(raw); err != nil && strings.Contains(err.Error(), "hunter22") {
			t.Errorf("parseStoreURL(%q) = %q: shows the password", raw, err)
		}
	}
}
