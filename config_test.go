package leader_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/leadertest"
)

func TestNewRefusesBadConfig(t *testing.T) {
	t.Parallel()
	base := func() leader.Config { return leader.Config{Name: "jobs", ID: "a"} }
	tests := []struct {
		name   string
		modify func(*leader.Config)
		field  string
		rule   string
	}{
		{"an empty name", func(c *leader.Config) { c.Name = "" }, "Name", "is required"},
		{"a name too long", func(c *leader.Config) { c.Name = strings.Repeat("n", 201) }, "Name", "at most 200 bytes"},
		{"a name with a control character", func(c *leader.Config) { c.Name = "a\nb" }, "Name", "printable"},
		{"a name that is not UTF-8", func(c *leader.Config) { c.Name = "\xff" }, "Name", "UTF-8"},
		{"an ID too long", func(c *leader.Config) { c.ID = strings.Repeat("i", 201) }, "ID", "at most 200 bytes"},
		{"a TTL too short", func(c *leader.Config) { c.TTL = 999 * time.Millisecond }, "TTL", "at least 1s"},
		{"a negative TTL", func(c *leader.Config) { c.TTL = -time.Second }, "TTL", "at least 1s"},
		{"a TTL too long", func(c *leader.Config) { c.TTL = 25 * time.Hour }, "TTL", "at most 24h"},
		{"a renew interval not under TTL/3", func(c *leader.Config) { c.RenewInterval = 5*time.Second + 1 }, "RenewInterval", "at most TTL/3 (5s)"},
		{"a negative renew interval", func(c *leader.Config) { c.RenewInterval = -1 }, "RenewInterval", "more than 0"},
		{"a negative retry interval", func(c *leader.Config) { c.RetryInterval = -1 }, "RetryInterval", "more than 0"},
		{"a retry interval over the TTL", func(c *leader.Config) { c.RetryInterval = 16 * time.Second }, "RetryInterval", "at most TTL"},
		{"a negative drift margin", func(c *leader.Config) { c.DriftMargin = -1 }, "DriftMargin", "not be negative"},
		{"a drift margin over TTL/5", func(c *leader.Config) { c.DriftMargin = 4 * time.Second }, "DriftMargin", "at most TTL/5 (3s)"},
		{"a negative stop grace", func(c *leader.Config) { c.StopGrace = -1 }, "StopGrace", "more than 0"},
		{"a stop grace leaving no time for two renewals", func(c *leader.Config) { c.StopGrace = 4500 * time.Millisecond }, "StopGrace", "TTL - 2*RenewInterval - DriftMargin (4.25s)"},
	}
	for _, tt := range tests {
		t.Run("refuses "+tt.name, func(t *testing.T) {
			t.Parallel()
			cfg := base()
			tt.modify(&cfg)
			e, err := leader.New(leadertest.NewMemStore(), cfg)
			if e != nil {
				t.Error("New returned an Elector with an error")
			}
			var ce *leader.ConfigError
			if !errors.As(err, &ce) {
				t.Fatalf("err = %v, want *ConfigError", err)
			}
			if ce.Field != tt.field || !strings.Contains(ce.Rule, tt.rule) {
				t.Errorf("got field %q rule %q, want field %q rule containing %q", ce.Field, ce.Rule, tt.field, tt.rule)
			}
			if msg := err.Error(); !strings.Contains(msg, "Config."+tt.field) || !strings.Contains(msg, tt.rule) {
				t.Errorf("message %q does not name the field and the rule", msg)
			}
		})
	}

	t.Run("refuses a nil store", func(t *testing.T) {
		t.Parallel()
		if _, err := leader.New(nil, base()); err == nil || !strings.Contains(err.Error(), "store is nil") {
			t.Errorf("err = %v", err)
		}
	})
}

func TestConfigDefaults(t *testing.T) {
	t.Parallel()
	e, err := leader.New(leadertest.NewMemStore(), leader.Config{Name: "jobs"})
	if err != nil {
		t.Fatal(err)
	}
	c := e.Config()
	if c.TTL != 15*time.Second || c.RenewInterval != 5*time.Second || c.RetryInterval != 5*time.Second ||
		c.DriftMargin != 750*time.Millisecond || c.StopGrace != 3*time.Second {
		t.Errorf("defaults: TTL %v renew %v retry %v drift %v grace %v", c.TTL, c.RenewInterval, c.RetryInterval, c.DriftMargin, c.StopGrace)
	}
	if c.ID == "" || c.Logger == nil || c.Metrics == nil {
		t.Errorf("ID %q, Logger %v, Metrics %v: want defaults", c.ID, c.Logger, c.Metrics)
	}
	// Defaults scale with the TTL and are valid at the bounds.
	for _, ttl := range []time.Duration{leader.MinTTL, leader.MaxTTL} {
		if _, err := leader.New(leadertest.NewMemStore(), leader.Config{Name: "jobs", TTL: ttl}); err != nil {
			t.Errorf("TTL %v with defaults: %v", ttl, err)
		}
	}
}
