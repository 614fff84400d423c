package postgres

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
)

// Default option values.
const (
	// DefaultSchema is the schema used when Options.Schema is empty.
	DefaultSchema = "public"
	// DefaultTable is the table used when Options.Table is empty.
	DefaultTable = "leader_leases"
	// DefaultAdvisoryTable is the table used when Options.AdvisoryTable is
	// empty.
	DefaultAdvisoryTable = "leader_advisory"
	// DefaultMessageTable is the table used when Options.MessageTable is
	// empty.
	DefaultMessageTable = "leader_messages"
	// DefaultHeartbeatTable is the table used when Options.HeartbeatTable
	// is empty.
	DefaultHeartbeatTable = "leader_heartbeats"
	// DefaultStrategyTable is the table used when Options.StrategyTable
	// is empty.
	DefaultStrategyTable = "leader_strategies"
	// DefaultMaxConns is Options.MaxConns when it is zero.
	DefaultMaxConns = 2
	// DefaultCallTimeout is Options.CallTimeout when it is zero.
	DefaultCallTimeout = 30 * time.Second
	// DefaultConnectTimeout bounds each host's part in the opening of
	// each of a store's (and a Router's) own connections when the pool's
	// configuration sets no connect timeout (connect_timeout in the
	// connection string): a host of a multi-host connection string that
	// has vanished costs a new connection that long before the next host
	// is tried (see Failover in the package documentation).
	DefaultConnectTimeout = 5 * time.Second
	// DefaultTakeoverGrace is Options.TakeoverGrace when it is zero.
	DefaultTakeoverGrace = 50 * time.Millisecond
)

// maxIdentifierLength is PostgreSQL's NAMEDATALEN-1. Longer identifiers are
// silently truncated, so two different configured names could end up naming
// one table; they are refused instead.
const maxIdentifierLength = 63

// Options configures the stores (LeaseStore, AdvisoryStore), the Router and
// Migrate. The zero value is valid and uses the defaults. Every store and
// Router must use the same Schema and table names as the Migrate call that
// created their tables, and every store sharing a table must use the same
// Channel.
type Options struct {
	// Schema is the schema of the tables. Default DefaultSchema
	// ("public"). Migrate creates it if it does not exist. At most 63
	// bytes; any valid UTF-8 but NUL (it is always quoted).
	Schema string

	// Table is the name of the lease table (the lease strategy). Default
	// DefaultTable ("leader_leases"). At most 63 bytes; any characters (it
	// is always quoted).
	Table string

	// AdvisoryTable is the name of the advisory strategy's term table.
	// Default DefaultAdvisoryTable ("leader_advisory"). At most 63 bytes;
	// any valid UTF-8 but NUL (it is always quoted).
	AdvisoryTable string

	// MessageTable is the name of the Router's table of durable messages.
	// Default DefaultMessageTable ("leader_messages"). At most 63 bytes;
	// any valid UTF-8 but NUL (it is always quoted).
	MessageTable string

	// HeartbeatTable is the name of the lease strategy's heartbeat table
	// (see "Heartbeats" in the package documentation). Default
	// DefaultHeartbeatTable ("leader_heartbeats"). At most 63 bytes; any
	// valid UTF-8 but NUL (it is always quoted).
	HeartbeatTable string

	// StrategyTable is the name of the table that records which strategy
	// each election name is elected with, so that the lease and advisory
	// strategies never both grant one name (see "One strategy per name" in
	// the package documentation). Default DefaultStrategyTable
	// ("leader_strategies"). At most 63 bytes; any valid UTF-8 but NUL (it
	// is always quoted).
	StrategyTable string

	// Channel is the LISTEN/NOTIFY channel for the stores' wake-ups. The
	// payload of a release is the election name ("~r" and the name, for a
	// name that begins with '~'); that of a grant is "~g" and the name; a
	// name too long for a payload is sent as the empty payload. The
	// LeaseStore sends a grant's 5 ms after it, and a plain release with
	// other candidates' 5 ms after it, only if the lease is still free
	// then (see Wake-ups in the package documentation). Default "<schema>.<table>" (for
	// example "public.leader_leases"), or, when that is longer than 63
	// bytes, "leader_" followed by 16 hex digits of its SHA-256. At most 63
	// bytes. A Channel of 60 bytes at most also has candidate channels,
	// Channel followed by "~" and two hexadecimal digits, on which the
	// plain releases of both stores wake the candidate they name first
	// (see Wake-ups in the package documentation, and in AdvisoryStore's).
	Channel string

	// MessageChannel is the LISTEN/NOTIFY channel on which the Router
	// announces durable messages to the leader (the payload is the
	// Router's channel name). Default "<schema>.<message table>", shortened
	// like Channel. At most 63 bytes; not Channel, nor one of Channel's
	// candidate channels.
	MessageChannel string

	// TakeoverGrace is how long an AdvisoryStore lets pass, after a lock
	// whose previous holder left without a release was freed, before it
	// reports its grant: the time the previous holder, if it is alive,
	// has to learn that the server ended its session and step down (it
	// learns from the same event, so it needs far less). It is counted
	// from when the store's lock waiter saw that holder's mark freed (the
	// same backend under the same term), if it did (which is after the
	// server freed it), and otherwise from the grant. Whether the holder
	// left without a release is read from the row as the grant's update
	// finds it. The advisory strategy only. Default DefaultTakeoverGrace
	// (50ms); at least 0.
	TakeoverGrace time.Duration

	// MaxConns is how many connections of its own each LeaseStore and
	// AdvisoryStore opens at most, from the configuration of the pool given
	// to it, for its statements: they never wait for one of the pool's
	// connections, so a service whose own work holds every connection of
	// its pool keeps its leadership. A LeaseStore sends every statement on
	// them (a process renews all its leases in one statement per round); an
	// AdvisoryStore, whose candidates have a session each besides, sends
	// Observe and its first claim of a name on them. They are opened as
	// needed and closed when idle (the pool's MaxConnIdleTime), and closed
	// by Close. Besides them, each store keeps one connection for its
	// wake-ups, and an AdvisoryStore one per candidate and per watched
	// name; a LeaseStore opens up to MaxConns more for prepared handovers
	// (see the package documentation) and for the notices it sends a few
	// milliseconds after a grant or a release, when it first prepares or
	// awaits one or sends one (once it has held a lease), closed when idle
	// like the others. Default DefaultMaxConns (2);
	// at least 1.
	MaxConns int32

	// CallTimeout bounds each store call whose context has no deadline
	// (context.Background(), say), and Migrate: every call ends, even on a
	// server that accepts connections and never answers. The stores'
	// own connections are opened in the background, each host of the
	// connection string tried for DefaultConnectTimeout unless the
	// configuration sets a connect_timeout, so that a call cut short
	// does not cut short the opening of the connection that the next
	// call uses. Electors give every call a deadline of their own.
	// Default DefaultCallTimeout (30s); at least 0.
	CallTimeout time.Duration

	// Key returns the advisory lock key for an election name (the advisory
	// strategy only). Default AdvisoryKey. Every AdvisoryStore on one
	// database must use the same Key; see AdvisoryKey for the collision
	// risk of the default.
	Key func(name string) int64

	// Logger receives the problems of the stores' wake-up listeners and
	// lock waiters, and of Router.Serve (a warning when a connection is
	// lost or a handler fails, debug on each failed retry, info when it is
	// back). Default: discard.
	Logger *slog.Logger
}

// OptionsError reports an Options field that breaks a rule. NewLeaseStore
// and Migrate return it before touching the database.
type OptionsError struct {
	Field string // the Options field, for example "Table"
	Rule  string // the rule broken, for example "must be at most 63 bytes"
	Value string // the value given
}

// Error says which option breaks which rule, and its value.
func (e *OptionsError) Error() string {
	return fmt.Sprintf("postgres: invalid Options.%s %q: %s", e.Field, e.Value, e.Rule)
}

// withDefaults returns o with every zero field set to its default.
func (o Options) withDefaults() Options {
	if o.Schema == "" {
		o.Schema = DefaultSchema
	}
	if o.Table == "" {
		o.Table = DefaultTable
	}
	if o.AdvisoryTable == "" {
		o.AdvisoryTable = DefaultAdvisoryTable
	}
	if o.MessageTable == "" {
		o.MessageTable = DefaultMessageTable
	}
	if o.HeartbeatTable == "" {
		o.HeartbeatTable = DefaultHeartbeatTable
	}
	if o.StrategyTable == "" {
		o.StrategyTable = DefaultStrategyTable
	}
	if o.Channel == "" {
		o.Channel = defaultChannel(o.Schema, o.Table)
	}
	if o.MessageChannel == "" {
		o.MessageChannel = defaultChannel(o.Schema, o.MessageTable)
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.TakeoverGrace == 0 {
		o.TakeoverGrace = DefaultTakeoverGrace
	}
	if o.MaxConns == 0 {
		o.MaxConns = DefaultMaxConns
	}
	if o.CallTimeout == 0 {
		o.CallTimeout = DefaultCallTimeout
	}
	return o
}

func defaultChannel(schema, table string) string {
	return shortName(schema + "." + table)
}

// shortName returns s if PostgreSQL would keep it whole as an identifier,
// and otherwise "leader_" followed by 16 hex digits of its SHA-256.
func shortName(s string) string {
	if len(s) <= maxIdentifierLength {
		return s
	}
	sum := sha256.Sum256([]byte(s))
	return "leader_" + hex.EncodeToString(sum[:8])
}

// validate checks o, which has its defaults filled in.
func (o Options) validate() error {
	for _, f := range []struct{ field, value string }{
		{"Schema", o.Schema},
		{"Table", o.Table},
		{"AdvisoryTable", o.AdvisoryTable},
		{"MessageTable", o.MessageTable},
		{"HeartbeatTable", o.HeartbeatTable},
		{"StrategyTable", o.StrategyTable},
		{"Channel", o.Channel},
		{"MessageChannel", o.MessageChannel},
	} {
		switch {
		case len(f.value) > maxIdentifierLength:
			return &OptionsError{Field: f.field, Value: f.value,
				Rule: fmt.Sprintf("must be at most %d bytes (PostgreSQL truncates longer names), is %d", maxIdentifierLength, len(f.value))}
		case strings.ContainsRune(f.value, 0):
			return &OptionsError{Field: f.field, Value: f.value, Rule: "must not contain a NUL byte"}
		case !utf8.ValidString(f.value):
			return &OptionsError{Field: f.field, Value: f.value, Rule: "must be valid UTF-8"}
		}
	}
	switch {
	case o.AdvisoryTable == o.Table:
		return &OptionsError{Field: "AdvisoryTable", Value: o.AdvisoryTable, Rule: "must differ from Table"}
	case o.MessageTable == o.Table:
		return &OptionsError{Field: "MessageTable", Value: o.MessageTable, Rule: "must differ from Table"}
	case o.MessageTable == o.AdvisoryTable:
		return &OptionsError{Field: "MessageTable", Value: o.MessageTable, Rule: "must differ from AdvisoryTable"}
	case o.HeartbeatTable == o.Table || o.HeartbeatTable == o.AdvisoryTable || o.HeartbeatTable == o.MessageTable:
		return &OptionsError{Field: "HeartbeatTable", Value: o.HeartbeatTable, Rule: "must differ from Table, AdvisoryTable and MessageTable"}
	case o.StrategyTable == o.Table || o.StrategyTable == o.AdvisoryTable || o.StrategyTable == o.MessageTable || o.StrategyTable == o.HeartbeatTable:
		return &OptionsError{Field: "StrategyTable", Value: o.StrategyTable, Rule: "must differ from Table, AdvisoryTable, MessageTable and HeartbeatTable"}
	case o.MessageChannel == o.Channel:
		return &OptionsError{Field: "MessageChannel", Value: o.MessageChannel, Rule: "must differ from Channel"}
	case len(o.Channel) <= maxCandidateChannel && len(o.MessageChannel) == len(o.Channel)+3 &&
		strings.HasPrefix(o.MessageChannel, o.Channel+"~"):
		return &OptionsError{Field: "MessageChannel", Value: o.MessageChannel, Rule: "must not be Channel followed by \"~\" and two characters (Channel's candidate channels)"}
	}
	if o.TakeoverGrace < 0 {
		return &OptionsError{Field: "TakeoverGrace", Value: o.TakeoverGrace.String(), Rule: "must be at least 0"}
	}
	if o.MaxConns < 1 {
		return &OptionsError{Field: "MaxConns", Value: strconv.Itoa(int(o.MaxConns)), Rule: "must be at least 1"}
	}
	if o.CallTimeout < 0 {
		return &OptionsError{Field: "CallTimeout", Value: o.CallTimeout.String(), Rule: "must be at least 0"}
	}
	return nil
}

// qualifiedTable returns the quoted, schema-qualified lease table name.
func (o Options) qualifiedTable() string {
	return pgx.Identifier{o.Schema, o.Table}.Sanitize()
}

// qualifiedAdvisoryTable returns the quoted, schema-qualified name of the
// advisory strategy's table.
func (o Options) qualifiedAdvisoryTable() string {
	return pgx.Identifier{o.Schema, o.AdvisoryTable}.Sanitize()
}

// qualifiedMessageTable returns the quoted, schema-qualified name of the
// Router's message table.
func (o Options) qualifiedMessageTable() string {
	return pgx.Identifier{o.Schema, o.MessageTable}.Sanitize()
}

// qualifiedHeartbeatTable returns the quoted, schema-qualified name of the
// lease strategy's heartbeat table.
func (o Options) qualifiedHeartbeatTable() string {
	return pgx.Identifier{o.Schema, o.HeartbeatTable}.Sanitize()
}

// qualifiedStrategyTable returns the quoted, schema-qualified name of the
// table of each name's strategy.
func (o Options) qualifiedStrategyTable() string {
	return pgx.Identifier{o.Schema, o.StrategyTable}.Sanitize()
}

// qualifiedEpochTable returns the quoted, schema-qualified name of the
// table of server epochs (migration 008): the lease table's name followed
// by "_epochs", in the tables' schema, shortened like Channel when too
// long.
func (o Options) qualifiedEpochTable() string {
	return pgx.Identifier{o.Schema, shortName(o.Table + "_epochs")}.Sanitize()
}

// qualifiedStatusView returns the quoted, schema-qualified name of the
// view that shows who holds each name (migration 006): the lease table's
// name followed by "_status", in the tables' schema, shortened like
// Channel when too long.
func (o Options) qualifiedStatusView() string {
	return pgx.Identifier{o.Schema, shortName(o.Table + "_status")}.Sanitize()
}

// qualifiedFenceFunction returns the quoted, schema-qualified name of the
// fence function (migration 007, see Fence): the lease table's name
// followed by "_fence", in the tables' schema, shortened like Channel when
// too long.
func (o Options) qualifiedFenceFunction() string {
	return pgx.Identifier{o.Schema, shortName(o.Table + "_fence")}.Sanitize()
}

// qualifiedCandidateTable returns the quoted, schema-qualified name of the
// table of the candidates that campaign for each name (migration 009, see
// leader.Transferer): the lease table's name followed by "_candidates", in
// the tables' schema, shortened like Channel when too long. Both
// strategies use it.
func (o Options) qualifiedCandidateTable() string {
	return pgx.Identifier{o.Schema, shortName(o.Table + "_candidates")}.Sanitize()
}

// requestIndex returns the quoted name of the lease table's partial index
// on its heartbeat column for the rows with a request to hand over
// (migration 009), which lives in the table's schema.
func (o Options) requestIndex() string {
	return pgx.Identifier{shortName(o.Table + "_requests")}.Sanitize()
}

// heartbeatIndex returns the quoted name of the lease table's index on its
// heartbeat column, which lives in the table's schema.
func (o Options) heartbeatIndex() string {
	return pgx.Identifier{shortName(o.Table + "_heartbeat")}.Sanitize()
}

// messageIndex returns the quoted name of the message table's (channel, id)
// index, which lives in the table's schema.
func (o Options) messageIndex() string {
	return pgx.Identifier{shortName(o.MessageTable + "_channel_id")}.Sanitize()
}
