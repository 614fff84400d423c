//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"errors"
	"net/url"
	"path/filepath"
	"strings"
	"testing"

	"github.com/leaderelect/leader/cmd/leader/internal/redact"
)

// FuzzStoreURL checks parseStoreURL on any --store value: it never panics,
// refuses with a usage error, and neither its error, nor the URL it would
// display, nor redact.URL shows the URL's password: they read the same
// whatever the password is. The seed corpus is in
// testdata/fuzz/FuzzStoreURL.
func FuzzStoreURL(f *testing.F) {
	f.Add("")
	f.Add("postgres://app:s3cret@db.example:5432/leader?sslmode=disable")
	f.Add("postgresql://app:p%40ss%2Fw@127.0.0.1/db")
	f.Add("POSTGRES://app@h/db?password=hunter2")
	f.Add("file:///var/lib/leader")
	f.Add("file://host/var/lib/leader")
	f.Add("file://user:hunter2@elsewhere/dir")
	f.Add("file:relative")
	f.Add("mysql://root:hunter2@h/db")
	f.Add("ftp://u:pass%zzword@h/")
	f.Add("app:secret@host")

	f.Fuzz(func(t *testing.T, raw string) {
		spec, err := parseStoreURL(raw)
		if err != nil {
			var ue *usageError
			if !errors.As(err, &ue) || !strings.HasPrefix(err.Error(), "--store ") {
				t.Errorf("parseStoreURL(%q) = %T %v, want a usage error about --store", raw, err, err)
			}
		} else {
			checkStoreSpec(t, raw, spec)
		}

		u, perr := url.Parse(raw)
		if perr != nil || u.User == nil {
			return
		}
		pw, ok := u.User.Password()
		if !ok {
			return
		}
		// The same URL with another password must read the same.
		other, ok := withPassword(raw, "Qj7Qj7Qj7")
		if !ok {
			return
		}
		otherSpec, otherErr := parseStoreURL(other)
		show := func(spec storeSpec, err error) string {
			if err != nil {
				return "error: " + err.Error()
			}
			return "display: " + spec.display
		}
		got, want := show(spec, err), show(otherSpec, otherErr)
		if len(pw) >= 4 && strings.Contains(got, pw) && !strings.Contains(want, pw) {
			t.Fatalf("parseStoreURL(%q) shows its password %q: %s", raw, pw, got)
		}
		if got != want {
			t.Errorf("parseStoreURL depends on the password:\n%q: %s\n%q: %s", raw, got, other, want)
		}
		got, want = redact.URL(raw), redact.URL(other)
		if len(pw) >= 4 && strings.Contains(got, pw) && !strings.Contains(want, pw) {
			t.Fatalf("redact.URL(%q) = %q shows its password %q", raw, got, pw)
		}
		if got != want {
			t.Errorf("redact.URL depends on the password:\nURL(%q) = %q\nURL(%q) = %q", raw, got, other, want)
		}
	})
}

// checkStoreSpec checks what parseStoreURL made of raw.
func checkStoreSpec(t *testing.T, raw string, spec storeSpec) {
	t.Helper()
	switch spec.kind {
	case postgresStore:
		scheme, _, _ := strings.Cut(raw, "://")
		if s := strings.ToLower(scheme); s != "postgres" && s != "postgresql" {
			t.Errorf("parseStoreURL(%q) chose PostgreSQL for scheme %q", raw, scheme)
		}
	case fileStore:
		if !filepath.IsAbs(spec.dir) || filepath.Clean(spec.dir) != spec.dir {
			t.Errorf("parseStoreURL(%q) chose the directory %q, want a clean absolute path", raw, spec.dir)
		}
	default:
		t.Errorf("parseStoreURL(%q) chose store kind %d", raw, spec.kind)
	}
}

// withPassword returns raw with the password of its userinfo, as written,
// replaced by pw, if net/url reads the result as raw with only that
// password changed.
func withPassword(raw, pw string) (string, bool) {
	_, rest, ok := strings.Cut(raw, "://")
	if !ok {
		return "", false
	}
	start := len(raw) - len(rest)
	if i := strings.IndexAny(rest, "/?#"); i >= 0 {
		rest = rest[:i]
	}
	at := strings.LastIndex(rest, "@")
	if at < 0 {
		return "", false
	}
	colon := strings.Index(rest[:at], ":")
	if colon < 0 {
		return "", false
	}
	other := raw[:start+colon+1] + pw + raw[start+at:]

	a, errA := url.Parse(raw)
	b, errB := url.Parse(other)
	if errA != nil || errB != nil || a.User == nil || b.User == nil {
		return "", false
	}
	if got, _ := b.User.Password(); got != pw || a.User.Username() != b.User.Username() {
		return "", false
	}
	a.User, b.User = nil, nil
	if a.String() != b.String() {
		return "", false
	}
	return other, true
}
