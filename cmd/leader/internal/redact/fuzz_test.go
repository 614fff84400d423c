package redact

import (
	"errors"
	"log/slog"
	"net/url"
	"strings"
	"testing"
)

// FuzzRedact checks the Redactor built from any store URL: every password
// that net/url reads in the URL (the userinfo's, decoded and as written, and
// those of the password query parameters) is masked in any text that
// contains it, by String and by ReplaceAttr. The seed corpus is in
// testdata/fuzz/FuzzRedact.
func FuzzRedact(f *testing.F) {
	f.Add("postgres://u:topsecret@h/db", "failed: ")
	f.Add("postgres://u:p%40ssword@h/db", "a p@ssword b p%40ssword")
	f.Add("postgres://u@h/db?password=qwerty123&sslpassword=abc%20def", "pw ")
	f.Add("postgres://u:bad%zzpass@h:x/db", "oops ")
	f.Add("postgres://u:aaa@h/db", "aaaa aaaaa")
	f.Add("file:///var/lib/leader", "")
	f.Add("", "nothing")

	f.Fuzz(func(t *testing.T, raw, text string) {
		r := ForURL(raw)
		_ = URL(raw)
		for _, secret := range passwordsIn(raw) {
			// The mask's own letters could spell a secret made of them
			// once it is inserted; such a secret is not looked for.
			if len(secret) < minSecretLen || strings.ContainsAny(secret, Mask) {
				continue
			}
			in := text[:len(text)/2] + secret + text[len(text)/2:]
			if out := r.String(in); strings.Contains(out, secret) {
				t.Fatalf("ForURL(%q).String(%q) = %q keeps the password %q", raw, in, out, secret)
			}
			for _, a := range []slog.Attr{slog.String("msg", in), slog.Any("error", errors.New(in))} {
				if out := r.ReplaceAttr(nil, a).Value.String(); strings.Contains(out, secret) {
					t.Fatalf("ForURL(%q).ReplaceAttr(%v) = %q keeps the password %q", raw, a, out, secret)
				}
			}
		}
	})
}

// passwordsIn returns the passwords that net/url reads in raw: the
// userinfo's, decoded and as written, and the values of the password query
// parameters when the query parses.
func passwordsIn(raw string) []string {
	u, err := url.Parse(raw)
	if err != nil {
		return nil
	}
	var out []string
	if pw, ok := u.User.Password(); ok {
		out = append(out, pw)
		if _, rest, ok := strings.Cut(raw, "://"); ok {
			if i := strings.IndexAny(rest, "/?#"); i >= 0 {
				rest = rest[:i]
			}
			if at := strings.LastIndex(rest, "@"); at >= 0 {
				if _, written, ok := strings.Cut(rest[:at], ":"); ok {
					out = append(out, written)
				}
			}
		}
	}
	if q, err := url.ParseQuery(u.RawQuery); err == nil {
		out = append(out, q["password"]...)
		out = append(out, q["sslpassword"]...)
	}
	return out
}
