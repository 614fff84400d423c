// Package redact keeps secrets in store URLs out of logs, errors and output.
//
// Two layers: URL rewrites a store URL for display with its password (and any
// password query parameter) masked, and a Redactor, built from the store URL,
// masks the secret wherever it shows up in text, whatever produced that text
// (an error from a driver, a log record). The command prints store URLs only
// through URL and routes every log record and every error through a Redactor.
package redact

import (
	"log/slog"
	"net/url"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

// Mask replaces a secret.
const Mask = "xxxxx"

// minSecretLen is the shortest secret a Redactor masks inside free text.
// Masking every "a" of a log line for a one-letter password would make the
// line unreadable and protect nothing worth protecting; URL masks passwords
// of any length.
const minSecretLen = 3

// passwordParams are the query parameters that carry a password in
// PostgreSQL connection URLs.
var passwordParams = []string{"password", "sslpassword"}

// URL returns raw with its password, and any password query parameter,
// replaced by Mask. A URL that net/url refuses has its password masked in
// the text (see maskUnparsed); text without a scheme, or an opaque URL such
// as "user:pw@host", is returned as Mask whole, since there is no telling
// where a secret in it might be. Finally, pgx reads URLs as libpq does,
// which does not always agree with net/url on where the password is (a "#"
// in it, say): when they disagree, the password pgx reads is masked
// wherever it is left, if it is at least minSecretLen bytes long.
func URL(raw string) string {
	out := display(raw)
	pw := driverPassword(raw)
	if pw == "" || netURLReads(raw, pw) {
		return out
	}
	r := &Redactor{}
	forms(pw, func(s string) { r.secrets = append(r.secrets, s) })
	r.sort()
	return r.String(out)
}

// netURLReads reports whether net/url finds pw as raw's password or as one
// of its password query parameters, which display masks already.
func netURLReads(raw, pw string) bool {
	u, err := url.Parse(raw)
	if err != nil {
		return false
	}
	if p, ok := u.User.Password(); ok && p == pw {
		return true
	}
	q, err := url.ParseQuery(u.RawQuery)
	if err != nil {
		return false
	}
	for _, p := range passwordParams {
		if q.Get(p) == pw {
			return true
		}
	}
	return false
}

// display is URL without the final masking.
func display(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return maskUnparsed(raw)
	}
	if u.Scheme == "" || u.Opaque != "" {
		return Mask
	}
	if _, has := u.User.Password(); has {
		u.User = url.UserPassword(u.User.Username(), Mask)
	}
	if u.RawQuery != "" {
		q := u.Query()
		changed := false
		for _, p := range passwordParams {
			if q.Has(p) {
				q.Set(p, Mask)
				changed = true
			}
		}
		if changed {
			u.RawQuery = q.Encode()
		}
	}
	// url.URL.String escapes the mask's characters as it would a password's;
	// Mask needs no escaping, so the result reads as written.
	return u.String()
}

// Secrets returns the secrets found in a store URL: its password and its
// password query parameters, each as written and as decoded.
func Secrets(raw string) []string {
	var out []string
	add := func(s string) {
		if s == "" {
			return
		}
		for _, have := range out {
			if have == s {
				return
			}
		}
		out = append(out, s)
	}
	u, err := url.Parse(raw)
	if err != nil {
		// Unparseable: fall back to the text between the scheme's "//"
		// and the last "@", the conventional userinfo position.
		if rest, ok := strings.CutPrefix(raw[strings.Index(raw, ":")+1:], "//"); ok {
			if at := strings.LastIndex(rest, "@"); at >= 0 {
				if _, pw, ok := strings.Cut(rest[:at], ":"); ok {
					add(pw)
					if dec, err := url.PathUnescape(pw); err == nil {
						add(dec)
					}
				}
			}
		}
		addDriverPassword(raw, add)
		return out
	}
	if pw, has := u.User.Password(); has {
		add(pw)
		// The password as it appears in the URL's text (percent-encoded).
		if ui := u.User.String(); strings.Contains(ui, ":") {
			_, enc, _ := strings.Cut(ui, ":")
			add(enc)
		}
		if _, rawPW, ok := strings.Cut(userinfoOf(raw), ":"); ok {
			add(rawPW)
		}
	}
	q, err := url.ParseQuery(u.RawQuery)
	if err == nil {
		for _, p := range passwordParams {
			for _, v := range q[p] {
				add(v)
				add(url.QueryEscape(v))
			}
		}
	}
	addDriverPassword(raw, add)
	return out
}

// addDriverPassword adds the password pgx itself reads from raw, as
// written in any of the ways a URL may carry it, since pgx parses URLs as
// libpq does and not always as net/url does.
func addDriverPassword(raw string, add func(string)) {
	if pw := driverPassword(raw); pw != "" {
		forms(pw, add)
	}
}

// driverPassword returns the password pgx reads from raw, or "".
func driverPassword(raw string) string {
	cfg, err := pgconn.ParseConfig(raw)
	if err != nil {
		return ""
	}
	return cfg.Password
}

// forms passes pw to add as written plainly and in each way a URL may
// carry it, if pw is at least minSecretLen bytes long. The length is the
// secret's own, not its forms': the escaped form of a shorter password can
// be long enough ("%21" for "!"), and masking it would also mask the same
// text elsewhere in a URL (a user name "!"), so that what is shown would
// depend on the password.
func forms(pw string, add func(string)) {
	if len(pw) < minSecretLen {
		return
	}
	add(pw)
	add(url.QueryEscape(pw))
	add(url.PathEscape(pw))
	add(url.UserPassword("", pw).String()[1:])
}

// maskUnparsed masks the password of a URL that net/url refuses (a bad port,
// say), working on the text: the userinfo's password is the text between the
// first ":" and the last "@" of the authority. Anything less certain (no
// "://", a password query parameter) is masked whole.
func maskUnparsed(raw string) string {
	scheme, rest, ok := strings.Cut(raw, "://")
	if !ok || scheme == "" || strings.Contains(strings.ToLower(rest), "password") {
		return Mask
	}
	if ui := userinfoOf(raw); strings.Contains(ui, ":") {
		user, _, _ := strings.Cut(ui, ":")
		rest = user + ":" + Mask + rest[len(ui):]
	}
	return scheme + "://" + rest
}

// userinfoOf returns the userinfo of raw exactly as written.
func userinfoOf(raw string) string {
	_, rest, ok := strings.Cut(raw, "://")
	if !ok {
		return ""
	}
	if i := strings.IndexAny(rest, "/?#"); i >= 0 {
		rest = rest[:i]
	}
	at := strings.LastIndex(rest, "@")
	if at < 0 {
		return ""
	}
	return rest[:at]
}

// Redactor masks a fixed set of secrets in text. The zero value masks
// nothing. It is safe for concurrent use.
type Redactor struct {
	secrets []string // longest first, so a secret containing another is masked whole
}

// ForURL returns a Redactor for the secrets in the store URL raw.
func ForURL(raw string) *Redactor {
	r := &Redactor{}
	for _, s := range Secrets(raw) {
		if len(s) >= minSecretLen {
			r.secrets = append(r.secrets, s)
		}
	}
	r.sort()
	return r
}

// sort puts the longest secrets first.
func (r *Redactor) sort() {
	for i := 1; i < len(r.secrets); i++ {
		for j := i; j > 0 && len(r.secrets[j]) > len(r.secrets[j-1]); j-- {
			r.secrets[j], r.secrets[j-1] = r.secrets[j-1], r.secrets[j]
		}
	}
}

// String returns s with every secret replaced by Mask.
func (r *Redactor) String(s string) string {
	if r == nil {
		return s
	}
	for _, secret := range r.secrets {
		if strings.Contains(s, secret) {
			s = strings.ReplaceAll(s, secret, Mask)
		}
	}
	return s
}

// Error returns err's text with every secret masked.
func (r *Redactor) Error(err error) string {
	if err == nil {
		return ""
	}
	return r.String(err.Error())
}

// ReplaceAttr is a slog.HandlerOptions.ReplaceAttr that masks secrets in
// every string and error attribute, the message included.
func (r *Redactor) ReplaceAttr(_ []string, a slog.Attr) slog.Attr {
	if r == nil || len(r.secrets) == 0 {
		return a
	}
	switch a.Value.Kind() {
	case slog.KindString:
		if s := a.Value.String(); s != r.String(s) {
			a.Value = slog.StringValue(r.String(s))
		}
	case slog.KindAny:
		switch v := a.Value.Any().(type) {
		case error:
			a.Value = slog.StringValue(r.String(v.Error()))
		case interface{ String() string }:
			if s := v.String(); s != r.String(s) {
				a.Value = slog.StringValue(r.String(s))
			}
		}
	}
	return a
}
