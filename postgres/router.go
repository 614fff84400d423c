package postgres

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// MaxNotifyPayloadLen is the longest payload, in bytes, that Router.Notify
// sends: PostgreSQL refuses NOTIFY payloads of 8000 bytes or more. Durable
// messages have no such limit.
const MaxNotifyPayloadLen = 7999

// Timing and sizes of Router.Serve.
const (
	// routerBatchSize is how many durable messages of one channel Serve
	// reads at a time.
	routerBatchSize = 256
	// routerRetryMin and routerRetryMax bound the wait before a durable
	// channel whose handler failed is tried again; it doubles at each
	// failure in a row.
	routerRetryMin = 100 * time.Millisecond
	routerRetryMax = 5 * time.Second
	// routerReconnectMin and routerReconnectMax bound the backoff between
	// attempts to open Serve's connection again; it doubles at each failure.
	routerReconnectMin = 50 * time.Millisecond
	routerReconnectMax = 5 * time.Second
	// routerPollEvery is how often Serve reads every durable channel even
	// without a notification (one may have been missed) and checks that its
	// connection still works.
	routerPollEvery = 30 * time.Second
	// routerCallTimeout bounds the session check, LISTEN and a ping
	// (connecting takes up to the connect timeout per host, see
	// dialer.within).
	routerCallTimeout = 10 * time.Second
	// routerFinishTimeout bounds deleting a handled message, or counting a
	// failed attempt, after ctx may have ended.
	routerFinishTimeout = 5 * time.Second
)

// Router routes messages that any instance sends to the handlers of the
// current leader only. It works beside any leader.Store: it needs a pool on
// the database that holds its message table (see Migrate) and, in Serve, the
// leader context that the Elector gives to OnElected.
//
// Every instance creates a Router and registers the same handlers with
// Handle; the leader calls Serve from OnElected; anyone calls Notify,
// NotifyDurable or NotifyDurableTx:
//
//	r, _ := postgres.NewRouter(pool, postgres.Options{})
//	_ = r.Handle("jobs", func(ctx context.Context, m postgres.Message) error { ... })
//	elector, _ := leader.New(store, leader.Config{
//		Name:      "scheduler",
//		OnElected: func(ctx context.Context) { _ = r.Serve(ctx) },
//	})
//
// # Two kinds of message
//
// Notify is best effort: it is a plain PostgreSQL NOTIFY on the PostgreSQL
// channel of the same name, exactly as given, so anything that can NOTIFY
// reaches the leader too: a trigger's pg_notify('jobs', ...), or psql's
// NOTIFY "jobs", '...' (quote the name: unquoted names are folded to lower
// case). A message is dropped, without an error, when no leader listens:
// while no instance leads, while a new leader is starting Serve, and while
// a leader re-opens a broken connection. Its payload must be shorter than
// 8000 bytes.
//
// NotifyDurable and NotifyDurableTx store the message in the message table
// (Options.MessageTable) and announce it on Options.MessageChannel in the
// same statement; the leader deletes it only once its handler has returned
// nil. Durable messages are therefore delivered at least once, whoever
// leads and whenever: messages sent while no one leads wait for the next
// leader, and a failover in the middle of a stream loses none. After a
// failover the new leader may deliver again what the old one had handled
// but not yet deleted: a handler of durable messages must tolerate
// duplicates (Message.ID identifies them). They are rare when the leader's
// process dies, as the server completes a DELETE it has received; they come
// from a connection lost between a handler's return and its DELETE, or
// from a handler that ran on after its leadership ended.
//
// # Delivery
//
// Serve runs the handlers on the goroutine that called it, one message at
// a time: handlers of one Router never run concurrently. Best-effort
// messages are handled in the order Serve receives them; a handler's error
// is logged and the message is dropped.
//
// Serve delivers the durable messages of each handled channel in id order,
// that is in the order they were inserted: it reads the smallest ids left
// in the table, calls the handler for each, and deletes each one once its
// handler returned nil. When a handler returns an error
// the message's Attempts is incremented, the channel stops there (later
// messages wait, so that order is kept) and is tried again after a backoff
// of 100ms, doubling up to 5s, for as long as the leadership lasts; other
// channels go on. Serve reads a channel when it starts, on each
// announcement, after it re-opened its connection, and every 30 seconds in
// case an announcement was missed. Senders that commit concurrently may
// commit a smaller id after a larger one was delivered; it is delivered
// next, so none is skipped, but order holds only between messages whose
// sending transactions committed one after the other.
//
// Messages of a channel for which the leader has no handler stay in the
// table (and best-effort ones are dropped) until a leader that handles the
// channel serves.
//
// # Channel names and payloads
//
// A channel name is 1 to 63 bytes of valid UTF-8 without control
// characters, and may not be Options.MessageChannel; it is case-sensitive.
// A payload is valid UTF-8 without NUL bytes (PostgreSQL text holds
// neither); it is always sent as a query parameter. Calls that break a rule
// return a *ChannelError or a *PayloadError and send nothing.
//
// Options.Logger receives Serve's warnings: a handler's error, a durable
// message that could not be read or deleted, and a lost connection (then
// debug on each failed retry, and info when it is back).
//
// A Router is safe for concurrent use. It holds no resources of its own
// outside Serve, which opens and closes its connection.
type Router struct {
	pool   *pgxpool.Pool
	opts   Options
	log    *slog.Logger
	dialer dialer // Serve's connection
	sql    routerStatements

	mu       sync.Mutex
	handlers map[string]Handler
	serving  bool

	// pollEvery is routerPollEvery; tests shorten it.
	pollEvery time.Duration
	// onListen, set only by tests, is called with the backend PID of
	// Serve's connection each time it has LISTENed, before it reads the
	// durable channels.
	onListen func(pid uint32)
}

// Handler handles one message on the leader, on Serve's goroutine. ctx is
// Serve's ctx: it is cancelled when leadership ends, and carries the term
// (also in m.Term). For a durable message, returning nil lets the Router
// delete it, and an error has it delivered again later; for a best-effort
// message an error is only logged. Return soon after ctx is cancelled: once
// the lease runs out, the next leader may deliver the same durable message
// while this handler still runs.
type Handler func(ctx context.Context, m Message) error

// Message is a message as a Handler receives it.
type Message struct {
	// Channel is the channel the message was sent on.
	Channel string
	// Payload is the payload, byte for byte as sent.
	Payload string
	// Durable is true for a message sent with NotifyDurable or
	// NotifyDurableTx, false for one sent with Notify or a NOTIFY.
	Durable bool
	// ID is a durable message's id in the message table; it grows with
	// each message sent, and identifies a message delivered more than once.
	// Zero for a best-effort message.
	ID int64
	// Attempts is how many deliveries of a durable message failed before
	// this one (its handler returned an error). Zero for a best-effort
	// message.
	Attempts int
	// Term is the fencing term of the leadership that delivers the message
	// (see leader.TermFrom).
	Term uint64
}

// ChannelError reports a channel name that breaks a rule. Handle, Notify,
// NotifyDurable and NotifyDurableTx return it before sending anything.
type ChannelError struct {
	Channel string // the name given
	Rule    string // the rule broken, for example "must be at most 63 bytes, is 64"
}

// Error says which name breaks which rule.
func (e *ChannelError) Error() string {
	return fmt.Sprintf("postgres: invalid channel name %q: %s", e.Channel, e.Rule)
}

// PayloadError reports a payload that breaks a rule. Notify, NotifyDurable
// and NotifyDurableTx return it before sending anything. The payload itself
// is not repeated in the message.
type PayloadError struct {
	Channel string // the channel it was sent on
	Size    int    // its length in bytes
	Rule    string // the rule broken
}

// Error says which rule the payload breaks, and its size.
func (e *PayloadError) Error() string {
	return fmt.Sprintf("postgres: invalid payload of %d bytes for channel %q: %s", e.Size, e.Channel, e.Rule)
}

// NewRouter returns a Router on the message table that Migrate created with
// the same opts, or an *OptionsError if opts break a rule. It does not touch
// the database. The pool stays the caller's.
func NewRouter(pool *pgxpool.Pool, opts Options) (*Router, error) {
	if pool == nil {
		return nil, errors.New("postgres: NewRouter: pool is nil")
	}
	opts = opts.withDefaults()
	if err := opts.validate(); err != nil {
		return nil, err
	}
	return &Router{
		pool:      pool,
		opts:      opts,
		log:       opts.Logger.With(slog.String("message_channel", opts.MessageChannel)),
		dialer:    newDialer(pool),
		sql:       newRouterStatements(opts.qualifiedMessageTable()),
		handlers:  make(map[string]Handler),
		pollEvery: routerPollEvery,
	}, nil
}

// Options returns the Router's options with their defaults filled in.
func (r *Router) Options() Options { return r.opts }

// Handle registers h for channel: while this instance leads and Serve runs,
// h receives the best-effort and the durable messages sent on channel
// (Message.Durable tells them apart). Register every handler before Serve.
// Handle returns a *ChannelError for an invalid name, and an error if
// channel already has a handler or Serve is running.
func (r *Router) Handle(channel string, h Handler) error {
	if err := r.checkChannel(channel); err != nil {
		return err
	}
	if h == nil {
		return fmt.Errorf("postgres: Router.Handle %q: handler is nil", channel)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.serving {
		return fmt.Errorf("postgres: Router.Handle %q: Serve is running; register handlers before calling it", channel)
	}
	if _, ok := r.handlers[channel]; ok {
		return fmt.Errorf("postgres: Router.Handle %q: channel already has a handler", channel)
	}
	r.handlers[channel] = h
	return nil
}

// Notify sends payload on channel, best effort: the current leader's
// handler for channel receives it if it is listening, and nobody does
// otherwise (see Router). It is SELECT pg_notify(channel, payload): sent
// when the statement commits, and received by anything that LISTENs on
// channel. payload must be at most MaxNotifyPayloadLen (7999) bytes; use
// NotifyDurable for more.
func (r *Router) Notify(ctx context.Context, channel, payload string) error {
	ctx, cancel := r.opts.bound(ctx)
	defer cancel()
	if err := r.check(channel, payload, MaxNotifyPayloadLen); err != nil {
		return err
	}
	if _, err := r.pool.Exec(ctx, r.sql.notify, channel, payload); err != nil {
		return wrapError(ctx, call("notify", channel), err)
	}
	return nil
}

// NotifyDurable stores payload as a message on channel and announces it to
// the leader, in one statement. Once it returns nil, the message will be
// delivered to a leader's handler for channel at least once (see Router).
func (r *Router) NotifyDurable(ctx context.Context, channel, payload string) error {
	ctx, cancel := r.opts.bound(ctx)
	defer cancel()
	if err := r.check(channel, payload, -1); err != nil {
		return err
	}
	if _, err := r.pool.Exec(ctx, r.sql.notifyDurable, channel, payload, r.opts.MessageChannel); err != nil {
		return wrapError(ctx, call("notify durable", channel), err)
	}
	return nil
}

// NotifyDurableTx is NotifyDurable within the caller's transaction tx (an
// outbox): the message exists, and the leader hears of it, only if and when
// tx commits. tx must be on the database of the Router's pool.
func (r *Router) NotifyDurableTx(ctx context.Context, tx pgx.Tx, channel, payload string) error {
	ctx, cancel := r.opts.bound(ctx)
	defer cancel()
	if tx == nil {
		return fmt.Errorf("postgres: %s: tx is nil", call("notify durable", channel))
	}
	if err := r.check(channel, payload, -1); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, r.sql.notifyDurable, channel, payload, r.opts.MessageChannel); err != nil {
		return wrapError(ctx, call("notify durable", channel), err)
	}
	return nil
}

// checkChannel refuses a channel name that PostgreSQL would truncate or
// refuse, that logs could not show safely, or that is the Router's own.
func (r *Router) checkChannel(channel string) error {
	bad := func(rule string, args ...any) error {
		return &ChannelError{Channel: channel, Rule: fmt.Sprintf(rule, args...)}
	}
	switch {
	case channel == "":
		return bad("must not be empty")
	case len(channel) > maxIdentifierLength:
		return bad("must be at most %d bytes (PostgreSQL's limit for a channel name), is %d", maxIdentifierLength, len(channel))
	case !utf8.ValidString(channel):
		return bad("must be valid UTF-8")
	case strings.ContainsRune(channel, 0):
		return bad("must not contain a NUL byte")
	case channel == r.opts.MessageChannel:
		return bad("is Options.MessageChannel, on which the Router announces durable messages")
	}
	for _, c := range channel {
		if unicode.IsControl(c) {
			return bad("must not contain control characters (contains %q)", c)
		}
	}
	return nil
}

// check refuses an invalid channel name, and a payload that PostgreSQL
// text cannot hold or that is longer than limit bytes (-1: no limit).
func (r *Router) check(channel, payload string, limit int) error {
	if err := r.checkChannel(channel); err != nil {
		return err
	}
	bad := func(rule string, args ...any) error {
		return &PayloadError{Channel: channel, Size: len(payload), Rule: fmt.Sprintf(rule, args...)}
	}
	if limit >= 0 && len(payload) > limit {
		return bad("must be at most %d bytes, as PostgreSQL refuses NOTIFY payloads of %d bytes or more; send it with NotifyDurable, which has no size limit",
			limit, limit+1)
	}
	if i := strings.IndexByte(payload, 0); i >= 0 {
		return bad("must not contain a NUL byte (found at byte %d)", i)
	}
	if !utf8.ValidString(payload) {
		return bad("must be valid UTF-8 (invalid at byte %d)", invalidUTF8At(payload))
	}
	return nil
}

// invalidUTF8At returns the offset of the first invalid UTF-8 sequence in s.
func invalidUTF8At(s string) int {
	for i, c := range s {
		if c == utf8.RuneError {
			if _, size := utf8.DecodeRuneInString(s[i:]); size == 1 {
				return i
			}
		}
	}
	return len(s)
}

// routerStatements are the Router's SQL, with the table name filled in.
type routerStatements struct {
	notify, notifyDurable, fetch, remove, failed string
}

func newRouterStatements(table string) routerStatements {
	return routerStatements{
		// Notify: $1 channel, $2 payload.
		notify: `SELECT pg_notify($1, $2)`,

		// NotifyDurable: $1 channel, $2 payload, $3 the message channel.
		// The announcement is sent when, and only if, the insert commits.
		notifyDurable: fmt.Sprintf(`
WITH sent AS (
	INSERT INTO %s (channel, payload) VALUES ($1, $2)
	RETURNING channel
)
SELECT pg_notify($3, sent.channel) FROM sent`, table),

		// Fetch: $1 channel, $2 batch size. Always the smallest ids left,
		// never from a cursor: a smaller id may commit after a larger one
		// was delivered.
		fetch: fmt.Sprintf(`
SELECT id, payload, attempts FROM %s
WHERE channel = $1
ORDER BY id
LIMIT $2`, table),

		// Remove: $1 id.
		remove: fmt.Sprintf(`DELETE FROM %s WHERE id = $1`, table),

		// Failed: $1 id.
		failed: fmt.Sprintf(`UPDATE %s SET attempts = attempts + 1 WHERE id = $1`, table),
	}
}
