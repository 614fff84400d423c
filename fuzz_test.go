package leader_test

import (
	"errors"
	"math"
	"math/big"
	"os"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/leadertest"
)

// FuzzConfig checks New against the rules documented on Config: it never
// panics, it accepts exactly the configurations that keep every rule once
// the documented defaults are filled in, and it refuses the others with a
// *ConfigError that names a field breaking a rule and shows its value
// safely. The seed corpus is in testdata/fuzz/FuzzConfig.
func FuzzConfig(f *testing.F) {
	// add adds a seed; missing durations are zero (the default).
	add := func(name, id string, durations ...time.Duration) {
		d := make([]int64, 5)
		for i, v := range durations {
			d[i] = int64(v)
		}
		f.Add(name, id, d[0], d[1], d[2], d[3], d[4])
	}
	const s = time.Second
	add("jobs", "a")
	add("jobs", "")
	add("", "a")
	add("jobs", "a", leader.MinTTL)
	add("jobs", "a", leader.MaxTTL)
	add("jobs", "a", leader.MinTTL-1)
	add("jobs", "a", leader.MaxTTL+1)
	add("jobs", "a", 15*s, 5*s, 15*s, 3*s, 2*s)   // StopGrace at its limit, 15s - 2*5s - 3s
	add("jobs", "a", 15*s, 5*s, 15*s, 3*s, 2*s+1) // one past it
	add("jobs", "a", 15*s, 5*s+1)                 // RenewInterval past TTL/3
	add("jobs", "a", 15*s, -1, -1, -1, -1)
	add("jobs", "a", math.MaxInt64, math.MaxInt64, math.MaxInt64, math.MaxInt64, math.MaxInt64)
	add("jobs", "a", 15*s, math.MinInt64, math.MinInt64, math.MinInt64, math.MinInt64)
	add("a\nb", "a")
	add("jobs", "\xff")
	add(strings.Repeat("n", leader.MaxNameLen), strings.Repeat("i", leader.MaxNameLen+1))

	f.Fuzz(func(t *testing.T, name, id string, ttl, renew, retry, drift, grace int64) {
		in := leader.Config{
			Name:          name,
			ID:            id,
			TTL:           time.Duration(ttl),
			RenewInterval: time.Duration(renew),
			RetryInterval: time.Duration(retry),
			DriftMargin:   time.Duration(drift),
			StopGrace:     time.Duration(grace),
		}
		want := documentedDefaults(in)
		broken := brokenRules(want)

		e, err := leader.New(leadertest.NewMemStore(), in)
		if err != nil {
			if e != nil {
				t.Errorf("New returned an Elector with error %v", err)
			}
			checkConfigError(t, err, want, broken)
			return
		}
		if len(broken) > 0 {
			t.Fatalf("New accepted %+v, which breaks documented rules: %v", want, broken)
		}
		got := e.Config()
		if got.Name != want.Name || got.TTL != want.TTL || got.RenewInterval != want.RenewInterval ||
			got.RetryInterval != want.RetryInterval || got.DriftMargin != want.DriftMargin || got.StopGrace != want.StopGrace {
			t.Errorf("Config() = {Name %q TTL %v RenewInterval %v RetryInterval %v DriftMargin %v StopGrace %v}, want the documented defaults {%q %v %v %v %v %v}",
				got.Name, got.TTL, got.RenewInterval, got.RetryInterval, got.DriftMargin, got.StopGrace,
				want.Name, want.TTL, want.RenewInterval, want.RetryInterval, want.DriftMargin, want.StopGrace)
		}
		if id != "" && got.ID != id {
			t.Errorf("Config().ID = %q, want %q as given", got.ID, id)
		}
		if id == "" && !strings.HasSuffix(got.ID, "-"+strconv.Itoa(os.Getpid())) {
			t.Errorf("Config().ID = %q, want the default <hostname>-<pid>", got.ID)
		}
		if rule := labelRule(got.ID); rule != "" {
			t.Errorf("Config().ID = %q %s", got.ID, rule)
		}
		if got.Logger == nil || got.Metrics == nil {
			t.Errorf("Config() has Logger %v and Metrics %v, want defaults", got.Logger, got.Metrics)
		}
	})
}

// documentedDefaults returns c with the defaults that the Config fields
// document (except ID's, which New makes from the host).
func documentedDefaults(c leader.Config) leader.Config {
	if c.TTL == 0 {
		c.TTL = leader.DefaultTTL
	}
	if c.RenewInterval == 0 {
		c.RenewInterval = c.TTL / 3
	}
	if c.RetryInterval == 0 {
		c.RetryInterval = c.RenewInterval
	}
	if c.DriftMargin == 0 {
		c.DriftMargin = c.TTL / 20
	}
	if c.StopGrace == 0 {
		c.StopGrace = c.TTL / 5
	}
	return c
}

// brokenRules returns, for each field of c (defaults filled in) that breaks
// a rule documented on Config, that rule. It is written from the doc
// comments alone and judges each field on its own, whatever the order in
// which New checks them.
func brokenRules(c leader.Config) map[string]string {
	broken := make(map[string]string)
	if c.Name == "" {
		broken["Name"] = "is required"
	} else if rule := labelRule(c.Name); rule != "" {
		broken["Name"] = rule
	}
	if c.ID != "" { // an empty ID takes the default, "<hostname>-<pid>"
		if rule := labelRule(c.ID); rule != "" {
			broken["ID"] = rule
		}
	}
	if c.TTL < leader.MinTTL || c.TTL > leader.MaxTTL {
		broken["TTL"] = "in [MinTTL, MaxTTL]"
	}
	if c.RenewInterval <= 0 || c.RenewInterval > c.TTL/3 {
		broken["RenewInterval"] = "in (0, TTL/3]"
	}
	if c.RetryInterval <= 0 || c.RetryInterval > c.TTL {
		broken["RetryInterval"] = "in (0, TTL]"
	}
	if c.DriftMargin < 0 || c.DriftMargin > c.TTL/5 {
		broken["DriftMargin"] = "in [0, TTL/5]"
	}
	// DriftMargin + StopGrace <= TTL - 2*RenewInterval, in exact arithmetic:
	// out-of-range fields must not wrap around.
	sum := new(big.Int).SetInt64(int64(c.DriftMargin))
	sum.Add(sum, big.NewInt(int64(c.StopGrace)))
	sum.Add(sum, new(big.Int).Mul(big.NewInt(2), big.NewInt(int64(c.RenewInterval))))
	if c.StopGrace <= 0 || sum.Cmp(big.NewInt(int64(c.TTL))) > 0 {
		broken["StopGrace"] = "more than 0, and DriftMargin + StopGrace at most TTL - 2*RenewInterval"
	}
	return broken
}

// labelRule returns the rule that a Name or ID breaks: "1 to MaxNameLen
// bytes of printable UTF-8" (the emptiness of a Name is checked apart).
func labelRule(s string) string {
	if len(s) > leader.MaxNameLen {
		return "at most MaxNameLen bytes"
	}
	if !utf8.ValidString(s) {
		return "valid UTF-8"
	}
	for _, r := range s {
		if !strconv.IsPrint(r) {
			return "printable"
		}
	}
	return ""
}

// checkConfigError checks that err, New's refusal of want (defaults filled
// in), is a clear *ConfigError about a field that breaks a rule.
func checkConfigError(t *testing.T, err error, want leader.Config, broken map[string]string) {
	t.Helper()
	var ce *leader.ConfigError
	if !errors.As(err, &ce) {
		if len(broken) > 0 {
			t.Fatalf("New refused %+v with %T %v, want a *ConfigError", want, err, err)
		}
		t.Fatalf("New refused %+v, which keeps every documented rule: %v", want, err)
	}
	field, ok := reflect.TypeFor[leader.Config]().FieldByName(ce.Field)
	if !ok {
		t.Fatalf("ConfigError.Field = %q, not a Config field (error: %v)", ce.Field, err)
	}
	if _, ok := broken[ce.Field]; !ok {
		t.Errorf("New refused Config.%s = %v, which keeps its documented rule; broken: %v (error: %v)",
			ce.Field, formatField(want, ce.Field), broken, err)
	}
	if strings.TrimSpace(ce.Rule) == "" {
		t.Errorf("ConfigError for %s has no rule: %v", ce.Field, err)
	}
	if ce.Field != "ID" || want.ID != "" { // a bad default ID is the host's doing, not compared here
		if given := reflect.ValueOf(want).FieldByIndex(field.Index).Interface(); !reflect.DeepEqual(ce.Value, given) {
			t.Errorf("ConfigError.Value = %#v, want the value given (defaults filled in) %#v", ce.Value, given)
		}
	}
	msg := err.Error()
	if !strings.Contains(msg, "Config."+ce.Field) || !strings.Contains(msg, ce.Rule) {
		t.Errorf("message %q does not name Config.%s and the rule %q", msg, ce.Field, ce.Rule)
	}
	if s, ok := ce.Value.(string); ok && !strings.Contains(msg, strconv.Quote(s)) {
		t.Errorf("message %q does not show the value %q quoted", msg, s)
	}
	if !utf8.ValidString(msg) {
		t.Errorf("message %q is not valid UTF-8", msg)
	}
	for _, r := range msg {
		if !unicode.IsPrint(r) {
			t.Errorf("message %q contains the unprintable %U", msg, r)
			break
		}
	}
}

// formatField returns the value of c's field name, for a failure message.
func formatField(c leader.Config, name string) any {
	v := reflect.ValueOf(c).FieldByName(name)
	if !v.IsValid() {
		return nil
	}
	return v.Interface()
}
