package postgres

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
)

func TestOptions(t *testing.T) {
	t.Parallel()
	t.Run("the zero value takes the defaults", func(t *testing.T) {
		o := Options{}.withDefaults()
		if o.Schema != "public" || o.Table != "leader_leases" || o.Channel != "public.leader_leases" || o.Logger == nil {
			t.Fatalf("defaults: %+v", o)
		}
		if err := o.validate(); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("a long schema and table get a hashed default channel", func(t *testing.T) {
		o := Options{Schema: strings.Repeat("s", 40), Table: strings.Repeat("t", 40)}.withDefaults()
		if !strings.HasPrefix(o.Channel, "leader_") || len(o.Channel) != len("leader_")+16 {
			t.Fatalf("channel %q", o.Channel)
		}
		if err := o.validate(); err != nil {
			t.Fatal(err)
		}
	})
	bad := []struct {
		opts  Options
		field string
		rule  string
	}{
		{Options{Table: strings.Repeat("x", 64)}, "Table", "at most 63 bytes"},
		{Options{Schema: strings.Repeat("é", 32)}, "Schema", "at most 63 bytes"},
		{Options{Channel: strings.Repeat("c", 64)}, "Channel", "at most 63 bytes"},
		{Options{Schema: "a\x00b"}, "Schema", "NUL"},
		{Options{Table: "\x00"}, "Table", "NUL"},
		{Options{Channel: "wake", MessageChannel: "wake~0a"}, "MessageChannel", "candidate channels"},
	}
	for _, tc := range bad {
		t.Run(fmt.Sprintf("%s breaking %q is refused", tc.field, tc.rule), func(t *testing.T) {
			_, err := NewLeaseStore(&pgxpool.Pool{}, tc.opts)
			var oe *OptionsError
			if !errors.As(err, &oe) || oe.Field != tc.field || !strings.Contains(oe.Rule, tc.rule) {
				t.Fatalf("NewLeaseStore(%+v) = %v; want an *OptionsError for %s (%s)", tc.opts, err, tc.field, tc.rule)
			}
			if !strings.Contains(err.Error(), "Options."+tc.field) {
				t.Fatalf("error %q does not name the field", err)
			}
			if err := Migrate(t.Context(), &pgxpool.Pool{}, tc.opts); !errors.As(err, &oe) {
				t.Fatalf("Migrate(%+v) = %v; want an *OptionsError before touching the database", tc.opts, err)
			}
		})
	}
	t.Run("a nil pool is refused", func(t *testing.T) {
		if _, err := NewLeaseStore(nil, Options{}); err == nil {
			t.Fatal("NewLeaseStore(nil) succeeded")
		}
		if err := Migrate(t.Context(), nil, Options{}); err == nil {
			t.Fatal("Migrate(nil) succeeded")
		}
	})
}
