package leader

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"os"
	"strconv"
	"time"
	"unicode"
	"unicode/utf8"
)

// Bounds and defaults of Config. They are exported so that tools built on the
// library (the leader command, for one) can show them in help texts.
const (
	// DefaultTTL is the lease length when Config.TTL is zero.
	DefaultTTL = 15 * time.Second
	// MinTTL is the shortest TTL New accepts.
	MinTTL = time.Second
	// MaxTTL is the longest TTL New accepts.
	MaxTTL = 24 * time.Hour
	// MaxNameLen is the longest Config.Name, and Config.ID, in bytes.
	MaxNameLen = 200
	// MinPriority and MaxPriority bound Config.Priority (a 32-bit
	// integer, as stores keep it).
	MinPriority = math.MinInt32
	MaxPriority = math.MaxInt32
)

// Config configures an Elector. Only Name is required; every other zero field
// takes the default documented on it. New validates the whole Config and
// refuses it with an error naming the field and the rule it breaks; see
// ConfigError.
//
// The timing fields relate as follows, for one renewal sent at time s on the
// leader's monotonic clock:
//
//	s ─── RenewInterval ───> next renewal ... ─> stop ──StopGrace──> deadline ──DriftMargin──> s+TTL
//
// The store grants the lease until its own now+TTL, and its now is no earlier
// than s, so the leader's deadline (s + TTL - DriftMargin) always falls inside
// the store's lease. If no renewal succeeds before "stop", the leader context
// is cancelled and OnDemoted is called, leaving StopGrace for work to end
// before the deadline.
type Config struct {
	// Name is the election: all instances campaigning for one Name elect one
	// leader. Required; 1 to MaxNameLen bytes of printable UTF-8.
	Name string

	// ID is this instance's human-readable candidate ID, shown as the leader
	// in Status, logs and the store. It need not be unique (the store tells
	// instances apart by a random token), but unique IDs make status output
	// readable. At most MaxNameLen bytes of printable UTF-8. Default:
	// "<hostname>-<pid>".
	ID string

	// TTL is how long a grant or renewal is valid on the store's clock.
	// A crashed leader is replaced within about TTL. Default DefaultTTL
	// (15s); at least MinTTL (1s), at most MaxTTL (24h).
	TTL time.Duration

	// RenewInterval is how often the leader renews; a failed renewal is
	// retried after RenewInterval/4. Default TTL/3; more than 0 and at most
	// TTL/3, so that at least two renewals are tried before the lease could
	// run out. Renewals fall on a grid of period RenewInterval shared by
	// the process (so at most RenewInterval apart, the first one sometimes
	// sooner): Electors with the same RenewInterval renew at the same
	// moments, and on a store that implements BatchRenewer (the PostgreSQL
	// lease store) one goroutine of the process renews all their leases
	// with one request per round.
	RenewInterval time.Duration

	// RetryInterval is how long a follower waits before its next attempt
	// when the store gave it no expiry to wait for (after an error, or when
	// the lease was free but another candidate won it), and how long an
	// instance sits out after losing or resigning leadership before it
	// campaigns again, so that healthy candidates get the lease first.
	// Followers otherwise wake a moment after the expiry the store reported
	// (RenewInterval/10, at most 25ms, plus a little jitter: the leader's
	// renewals fall on its lease's expiry, and an attempt just before one
	// would have to be made again), or at once when the store signals a
	// release. Default RenewInterval; more than 0 and at most TTL.
	RetryInterval time.Duration

	// DriftMargin is subtracted from the leader's local deadline to cover
	// the difference in rate between the leader's clock and the store's.
	// Default TTL/20; at least 0 and at most TTL/5.
	DriftMargin time.Duration

	// StopGrace is how long before its local deadline a leader whose
	// renewals keep failing gives up: the leader context is cancelled and
	// OnDemoted is called, which should return within StopGrace.
	// Default TTL/5; more than 0, and DriftMargin + StopGrace must be at
	// most TTL - 2*RenewInterval, so that two renewals are tried first.
	StopGrace time.Duration

	// OnElected is called on a new goroutine each time this instance is
	// granted the lease. ctx is cancelled the moment leadership is lost for
	// any reason (including Run's context ending) and carries the fencing
	// term (see TermFrom). OnElected may block until ctx is done or return at
	// once after starting work; leadership does not end when it returns.
	// Optional.
	OnElected func(ctx context.Context)

	// OnDemoted is called exactly once for each leadership lost, on Run's
	// goroutine, after the leader context has been cancelled. OnElected runs
	// concurrently, so after a very short leadership OnDemoted may run before
	// OnElected's body does (which then sees its ctx already cancelled). It
	// should
	// block until all leader work has stopped: the Elector does not release
	// the lease or campaign again until OnDemoted has returned and OnElected
	// has returned. Optional.
	OnDemoted func()

	// OnNewLeader is called when the leader this instance observes changes
	// (another holder, a new term, or no holder), including when this
	// instance becomes leader. Calls are made in order on one goroutine
	// owned by the Elector; if a call is slow, intermediate changes are
	// skipped and the next call reports the latest. Optional.
	OnNewLeader func(Status)

	// Priority ranks this instance as a successor. When the leader's
	// store implements Transferer (every store of this module does), a
	// candidate whose Priority is above the leader's asks it to hand
	// over, and the leader does once it has led for MinTenure, to the
	// candidate with the highest Priority; Elector.Transfer and
	// RequestTransfer without a candidate ID pick that one too. Equal
	// priorities never move leadership, so there is no loop between
	// equals. Use it to prefer a zone, or the newest release in a rolling
	// deploy. Default 0; between MinPriority and MaxPriority.
	Priority int
	// MinTenure is how long a leader leads before it hands over to a
	// candidate with a higher Priority, so that a stream of such
	// candidates cannot keep leadership moving. Transfers asked for
	// (Elector.Transfer, RequestTransfer) do not wait for it. Default
	// TTL; at least 0 and at most MaxTTL.
	MinTenure time.Duration
	// HandOverOnStop makes Run, when its context ends while this instance
	// leads, hand the lease to the best other candidate (as
	// Elector.Transfer with no candidate ID does) instead of releasing it:
	// the successor starts at once while the others wait, and Run returns
	// without campaigning again. With no other candidate, or a store that
	// does not implement Transferer, Run releases as usual. The leader
	// command's "run" sets it, so that SIGTERM hands over.
	HandOverOnStop bool
	// Logger receives the Elector's logs. Default slog.Default().
	Logger *slog.Logger

	// Metrics receives counters and timings. Default: none.
	Metrics Metrics
}

// ConfigError reports a Config field that breaks a rule. New returns it;
// nothing has started when it does.
type ConfigError struct {
	Field string // the Config field, for example "RenewInterval"
	Rule  string // the rule broken, for example "must be at most TTL/3 (5s)"
	Value any    // the value given
}

// Error says which field breaks which rule, and its value.
func (e *ConfigError) Error() string {
	return fmt.Sprintf("leader: invalid Config.%s %s: %s", e.Field, formatValue(e.Value), e.Rule)
}

func formatValue(v any) string {
	if s, ok := v.(string); ok {
		return strconv.Quote(s)
	}
	return fmt.Sprint(v)
}

// withDefaults returns c with every zero field set to its default.
func (c Config) withDefaults() Config {
	if c.ID == "" {
		host, err := os.Hostname()
		if err != nil || host == "" {
			host = "host"
		}
		c.ID = host + "-" + strconv.Itoa(os.Getpid())
	}
	if c.TTL == 0 {
		c.TTL = DefaultTTL
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
	if c.MinTenure == 0 {
		c.MinTenure = c.TTL
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Metrics == nil {
		c.Metrics = NopMetrics{}
	}
	return c
}

// validate checks c, which must already have its defaults.
func (c Config) validate() error {
	bad := func(field string, v any, rule string, args ...any) error {
		return &ConfigError{Field: field, Value: v, Rule: fmt.Sprintf(rule, args...)}
	}
	if c.Name == "" {
		return bad("Name", c.Name, "is required")
	}
	if err := checkLabel(c.Name); err != "" {
		return bad("Name", c.Name, "%s", err)
	}
	if err := checkLabel(c.ID); err != "" {
		return bad("ID", c.ID, "%s", err)
	}
	if c.TTL < MinTTL {
		return bad("TTL", c.TTL, "must be at least %v", MinTTL)
	}
	if c.TTL > MaxTTL {
		return bad("TTL", c.TTL, "must be at most %v", MaxTTL)
	}
	if c.RenewInterval <= 0 {
		return bad("RenewInterval", c.RenewInterval, "must be more than 0")
	}
	if c.RenewInterval > c.TTL/3 {
		return bad("RenewInterval", c.RenewInterval, "must be at most TTL/3 (%v)", c.TTL/3)
	}
	if c.RetryInterval <= 0 {
		return bad("RetryInterval", c.RetryInterval, "must be more than 0")
	}
	if c.RetryInterval > c.TTL {
		return bad("RetryInterval", c.RetryInterval, "must be at most TTL (%v)", c.TTL)
	}
	if c.DriftMargin < 0 {
		return bad("DriftMargin", c.DriftMargin, "must not be negative")
	}
	if c.DriftMargin > c.TTL/5 {
		return bad("DriftMargin", c.DriftMargin, "must be at most TTL/5 (%v)", c.TTL/5)
	}
	if c.StopGrace <= 0 {
		return bad("StopGrace", c.StopGrace, "must be more than 0")
	}
	if limit := c.TTL - 2*c.RenewInterval - c.DriftMargin; c.StopGrace > limit {
		return bad("StopGrace", c.StopGrace,
			"must be at most TTL - 2*RenewInterval - DriftMargin (%v), so that two renewals are tried before giving up", limit)
	}
	if c.Priority < MinPriority || c.Priority > MaxPriority {
		return bad("Priority", c.Priority, "must be between %d and %d", MinPriority, MaxPriority)
	}
	if c.MinTenure < 0 {
		return bad("MinTenure", c.MinTenure, "must not be negative")
	}
	if c.MinTenure > MaxTTL {
		return bad("MinTenure", c.MinTenure, "must be at most %v", MaxTTL)
	}
	return nil
}

// checkLabel returns what is wrong with a name or ID, or "".
func checkLabel(s string) string {
	if len(s) > MaxNameLen {
		return fmt.Sprintf("must be at most %d bytes, not %d", MaxNameLen, len(s))
	}
	if !utf8.ValidString(s) {
		return "must be valid UTF-8"
	}
	for _, r := range s {
		if !unicode.IsPrint(r) {
			return fmt.Sprintf("must be printable (contains %q)", r)
		}
	}
	return ""
}
