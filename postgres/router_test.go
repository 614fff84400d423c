package postgres

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/internal/pgtest"
)

// routerWait bounds every wait for a delivery, a leader or a LISTEN: long
// enough never to be reached on a loaded machine, short enough to fail.
const routerWait = 30 * time.Second

// routerEnv is what newRouterEnv gives a test: a fresh, migrated database
// and a lease store on it for the Electors.
type routerEnv struct {
	pool  *pgxpool.Pool
	store *LeaseStore
}

func newRouterEnv(t *testing.T) routerEnv {
	t.Helper()
	pool := pgtest.NewPool(t)
	if err := Migrate(routerCallCtx(t), pool, Options{}); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	store, err := NewLeaseStore(pool, Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(store.Close)
	return routerEnv{pool: pool, store: store}
}

// routerCallCtx returns a context for one call, bounded generously.
func routerCallCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), routerWait)
	t.Cleanup(cancel)
	return ctx
}

// routerLogger discards, unless LEADER_TEST_LOG is set.
func routerLogger(instance string) *slog.Logger {
	if os.Getenv("LEADER_TEST_LOG") == "" {
		return slog.New(slog.DiscardHandler)
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug})).With("instance", instance)
}

// testRouter is a Router whose LISTENs are reported on listening.
type testRouter struct {
	*Router
	listening chan uint32 // the backend PID, each time Serve has LISTENed
}

// router returns a Router with default options on env's database.
func (env routerEnv) router(t *testing.T, instance string) testRouter {
	t.Helper()
	r, err := NewRouter(env.pool, Options{Logger: routerLogger(instance)})
	if err != nil {
		t.Fatal(err)
	}
	tr := testRouter{Router: r, listening: make(chan uint32, 16)}
	r.onListen = func(pid uint32) {
		select {
		case tr.listening <- pid:
		default:
		}
	}
	return tr
}

// waitListening waits until r's Serve has LISTENed and returns its backend
// PID.
func (r testRouter) waitListening(t *testing.T) uint32 {
	t.Helper()
	select {
	case pid := <-r.listening:
		return pid
	case <-time.After(routerWait):
		t.Fatalf("Serve did not LISTEN within %v", routerWait)
		return 0
	}
}

// lead runs an Elector for election name whose OnElected serves r, until
// the test ends or stop is called. Serve's errors fail the test.
func (env routerEnv) lead(t *testing.T, name, id string, r testRouter) (e *leader.Elector, stop func()) {
	t.Helper()
	e, err := leader.New(env.store, leader.Config{
		Name:   name,
		ID:     id,
		TTL:    2 * time.Second,
		Logger: routerLogger(id),
		OnElected: func(ctx context.Context) {
			if err := r.Serve(ctx); err != nil {
				t.Errorf("%s: Serve: %v", id, err)
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	return e, electortest.Run(t, e)
}

// inbox records the messages a handler receives, in order.
type inbox struct {
	mu      sync.Mutex
	msgs    []Message
	arrived chan struct{} // a value after each message (coalesced)
	// fail, if set, decides the handler's result for each message.
	fail func(Message) error
}

func newInbox() *inbox { return &inbox{arrived: make(chan struct{}, 1)} }

func (b *inbox) handle(_ context.Context, m Message) error {
	b.mu.Lock()
	b.msgs = append(b.msgs, m)
	fail := b.fail
	b.mu.Unlock()
	select {
	case b.arrived <- struct{}{}:
	default:
	}
	if fail != nil {
		return fail(m)
	}
	return nil
}

func (b *inbox) messages() []Message {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.msgs)
}

// waitFor waits until the inbox holds at least n messages and returns them.
func (b *inbox) waitFor(t *testing.T, n int) []Message {
	t.Helper()
	deadline := time.After(routerWait)
	for {
		if msgs := b.messages(); len(msgs) >= n {
			return msgs
		}
		select {
		case <-b.arrived:
		case <-deadline:
			msgs := b.messages()
			t.Fatalf("%d messages received within %v, want %d: %v", len(msgs), routerWait, n, payloads(msgs))
			return nil
		}
	}
}

// payloads returns the payloads of msgs, in order.
func payloads(msgs []Message) []string {
	out := make([]string, len(msgs))
	for i, m := range msgs {
		out[i] = m.Payload
	}
	return out
}

// only returns the messages of msgs with the given durability, in order.
func only(msgs []Message, durable bool) []Message {
	return slices.DeleteFunc(slices.Clone(msgs), func(m Message) bool { return m.Durable != durable })
}

// storedMessages counts the rows of the message table.
func storedMessages(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(routerCallCtx(t), "SELECT count(*) FROM leader_messages").Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// waitNoStoredMessages waits until every durable message has been deleted.
func waitNoStoredMessages(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	electortest.Eventually(t, routerWait, "the message table to empty", func() bool { return storedMessages(t, pool) == 0 })
}

func TestRouterDeliversOnlyToTheLeader(t *testing.T) {
	t.Parallel()
	env := newRouterEnv(t)
	type instance struct {
		id     string
		router testRouter
		inbox  *inbox
		e      *leader.Elector
	}
	var instances []*instance
	for _, id := range []string{"a", "b"} {
		in := &instance{id: id, router: env.router(t, id), inbox: newInbox()}
		if err := in.router.Handle("jobs", in.inbox.handle); err != nil {
			t.Fatal(err)
		}
		in.e, _ = env.lead(t, "only-leader", id, in.router)
		instances = append(instances, in)
	}
	sender := env.router(t, "sender") // never leads, never serves

	leaderNow := func() *instance {
		var found *instance
		electortest.Eventually(t, routerWait, "a leader", func() bool {
			for _, in := range instances {
				if in.e.IsLeader() {
					found = in
					return true
				}
			}
			return false
		})
		return found
	}
	send := func(round string) []string {
		var sent []string
		for i := range 3 {
			p := fmt.Sprintf("%s best-effort %d", round, i)
			if err := sender.Notify(routerCallCtx(t), "jobs", p); err != nil {
				t.Fatal(err)
			}
			sent = append(sent, p)
			p = fmt.Sprintf("%s durable %d", round, i)
			if err := sender.NotifyDurable(routerCallCtx(t), "jobs", p); err != nil {
				t.Fatal(err)
			}
			sent = append(sent, p)
		}
		return sent
	}

	first := leaderNow()
	first.router.waitListening(t)
	sent := send("first")
	got := first.inbox.waitFor(t, len(sent))
	if p := payloads(got); !sameSet(p, sent) {
		t.Errorf("the leader %s received %q, want %q", first.id, p, sent)
	}
	term := first.e.Status().Term
	for _, m := range got {
		if m.Term != term {
			t.Errorf("message %q carries term %d, want the leader's %d", m.Payload, m.Term, term)
		}
	}

	if err := first.e.Resign(routerCallCtx(t)); err != nil {
		t.Fatal(err)
	}
	second := instances[0]
	if second == first {
		second = instances[1]
	}
	electortest.Eventually(t, routerWait, "the other instance to lead", second.e.IsLeader)
	second.router.waitListening(t)
	sent2 := send("second")
	got2 := second.inbox.waitFor(t, len(sent2))
	if p := payloads(got2); !sameSet(p, sent2) {
		t.Errorf("the new leader %s received %q, want %q", second.id, p, sent2)
	}
	if n := len(first.inbox.messages()); n != len(sent) {
		t.Errorf("the former leader %s received %d messages, want only the %d sent while it led", first.id, n, len(sent))
	}
	if n := len(second.inbox.messages()); n != len(sent2) {
		t.Errorf("%s received %d messages, want only the %d sent while it led", second.id, n, len(sent2))
	}
	waitNoStoredMessages(t, env.pool)
}

// sameSet reports whether a and b hold the same strings, in any order.
func sameSet(a, b []string) bool {
	return slices.Equal(slices.Sorted(slices.Values(a)), slices.Sorted(slices.Values(b)))
}

func TestRouterPayloadsArriveByteForByte(t *testing.T) {
	t.Parallel()
	env := newRouterEnv(t)
	r := env.router(t, "leader")
	box, oddBox := newInbox(), newInbox()
	// An odd channel name checks that LISTEN quotes it.
	const odd = `Odd "chan" 'name'; LISTEN x; ✓`
	if err := r.Handle("bytes", box.handle); err != nil {
		t.Fatal(err)
	}
	if err := r.Handle(odd, oddBox.handle); err != nil {
		t.Fatal(err)
	}
	env.lead(t, "bytes", "leader", r)
	r.waitListening(t)

	longest := strings.Repeat("é", (MaxNotifyPayloadLen-1)/2) + "x" // multi-byte, 7999 bytes
	if len(longest) != MaxNotifyPayloadLen {
		t.Fatalf("test payload is %d bytes", len(longest))
	}
	sent := []string{
		"plain",
		"",
		"it's 'quoted'",
		`"double" quotes`,
		`back\slash \\ \n \x00 \'`,
		`'); DROP TABLE leader_messages; --`,
		`$1 $2::text`,
		"%s %d %v %%",
		"emoji 😀👍🏽🏳️‍🌈",
		"combining e\u0301 a\u0308\u0323",
		"RTL שלום עולם مرحبا \u202eevil\u202c",
		"new\nlines\r\n\ttab",
		longest,
	}
	sender := env.router(t, "sender")
	for _, p := range sent {
		if err := sender.Notify(routerCallCtx(t), "bytes", p); err != nil {
			t.Fatalf("Notify %q: %v", p, err)
		}
	}
	// Durable payloads have no size limit.
	big := strings.Repeat("0123456789abcdef", 4096)
	for _, p := range append(slices.Clone(sent), big) {
		if err := sender.NotifyDurable(routerCallCtx(t), "bytes", p); err != nil {
			t.Fatalf("NotifyDurable %q: %v", p, err)
		}
	}
	// What triggers or psql send reaches the handler too.
	if _, err := env.pool.Exec(routerCallCtx(t), `NOTIFY bytes, 'from a NOTIFY statement'`); err != nil {
		t.Fatal(err)
	}
	if err := sender.Notify(routerCallCtx(t), odd, "to the odd channel"); err != nil {
		t.Fatal(err)
	}
	if err := sender.NotifyDurable(routerCallCtx(t), odd, "durably to the odd channel"); err != nil {
		t.Fatal(err)
	}

	got := box.waitFor(t, 2*len(sent)+2)
	wantBestEffort := append(slices.Clone(sent), "from a NOTIFY statement")
	if p := payloads(only(got, false)); !slices.Equal(p, wantBestEffort) {
		t.Errorf("best-effort payloads differ:\n got %q\nwant %q", p, wantBestEffort)
	}
	if p := payloads(only(got, true)); !slices.Equal(p, append(slices.Clone(sent), big)) {
		t.Errorf("durable payloads differ:\n got %q\nwant %q", p, append(slices.Clone(sent), big))
	}
	for _, m := range got {
		if m.Channel != "bytes" {
			t.Errorf("message on channel %q, want %q", m.Channel, "bytes")
		}
		if m.Durable != (m.ID != 0) {
			t.Errorf("message %q: Durable %v with ID %d", m.Payload, m.Durable, m.ID)
		}
	}
	gotOdd := oddBox.waitFor(t, 2)
	if p := payloads(gotOdd); !sameSet(p, []string{"to the odd channel", "durably to the odd channel"}) {
		t.Errorf("odd channel received %q", p)
	}
	for _, m := range gotOdd {
		if m.Channel != odd {
			t.Errorf("odd channel message on channel %q", m.Channel)
		}
	}
	waitNoStoredMessages(t, env.pool)
}

func TestRouterRefusesBadInput(t *testing.T) {
	t.Parallel()
	env := newRouterEnv(t)
	r := env.router(t, "sender")

	// Anything that reaches PostgreSQL on channel "jobs" shows up here.
	conn, err := pgx.ConnectConfig(routerCallCtx(t), env.pool.Config().ConnConfig)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	if _, err := conn.Exec(routerCallCtx(t), `LISTEN jobs`); err != nil {
		t.Fatal(err)
	}

	type sendFunc func(channel, payload string) error
	notifyTx := func(commit bool) sendFunc {
		return func(channel, payload string) error {
			tx, err := env.pool.Begin(routerCallCtx(t))
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tx.Rollback(context.Background()) }()
			if err := r.NotifyDurableTx(routerCallCtx(t), tx, channel, payload); err != nil {
				return err
			}
			if err := tx.Commit(routerCallCtx(t)); err != nil {
				t.Fatal(err)
			}
			return nil
		}
	}
	senders := map[string]sendFunc{
		"Notify":          func(c, p string) error { return r.Notify(routerCallCtx(t), c, p) },
		"NotifyDurable":   func(c, p string) error { return r.NotifyDurable(routerCallCtx(t), c, p) },
		"NotifyDurableTx": notifyTx(true),
	}

	t.Run("a best-effort payload of 8000 bytes or more is refused with its size, the limit and the alternative", func(t *testing.T) {
		for _, size := range []int{MaxNotifyPayloadLen + 1, MaxNotifyPayloadLen + 2, 1 << 20} {
			err := r.Notify(routerCallCtx(t), "jobs", strings.Repeat("x", size))
			var perr *PayloadError
			if !errors.As(err, &perr) || perr.Size != size || perr.Channel != "jobs" {
				t.Fatalf("Notify of %d bytes: %v, want a *PayloadError for that size", size, err)
			}
			for _, want := range []string{fmt.Sprint(size), "8000", "NotifyDurable"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not mention %s", err, want)
				}
			}
		}
	})

	t.Run("a payload with a NUL byte or invalid UTF-8 is refused by every sender", func(t *testing.T) {
		for name, send := range senders {
			for _, p := range []string{"a\x00b", "\x00", "caf\xe9", "ok \xff\xfe", "\xed\xa0\x80"} { // the last is a UTF-16 surrogate
				err := send("jobs", p)
				var perr *PayloadError
				if !errors.As(err, &perr) {
					t.Errorf("%s(%q): %v, want a *PayloadError", name, p, err)
				}
			}
		}
	})

	badNames := map[string]string{
		"":                       "must not be empty",
		strings.Repeat("c", 64):  "at most 63 bytes",
		strings.Repeat("é", 32):  "at most 63 bytes", // 64 bytes, 32 characters
		"a\x00b":                 "NUL",
		"a\nb":                   "control",
		"tab\there":              "control",
		"del\x7f":                "control",
		"c1\u0085":               "control",
		"bad\xff":                "UTF-8",
		"public.leader_messages": "MessageChannel",
	}
	t.Run("a bad channel name is refused by every sender and by Handle, naming the rule", func(t *testing.T) {
		for channel, rule := range badNames {
			check := func(what string, err error) {
				t.Helper()
				var cerr *ChannelError
				if !errors.As(err, &cerr) || cerr.Channel != channel {
					t.Errorf("%s on channel %q: %v, want a *ChannelError", what, channel, err)
					return
				}
				if !strings.Contains(err.Error(), rule) {
					t.Errorf("%s on channel %q: error %q does not say %q", what, channel, err, rule)
				}
			}
			for name, send := range senders {
				check(name, send(channel, "payload"))
			}
			check("Handle", r.Handle(channel, newInbox().handle))
		}
	})

	t.Run("names of 63 bytes, and any printable characters, are accepted by Handle", func(t *testing.T) {
		for _, channel := range []string{strings.Repeat("c", 63), strings.Repeat("é", 31) + "x", "Jobs", "jobs.v2 (eu-west) ✓", `"quoted"`} {
			if err := r.Handle(channel, newInbox().handle); err != nil {
				t.Errorf("Handle(%q): %v", channel, err)
			}
		}
	})

	t.Run("Handle refuses a second handler and a nil one", func(t *testing.T) {
		if err := r.Handle("twice", newInbox().handle); err != nil {
			t.Fatal(err)
		}
		if err := r.Handle("twice", newInbox().handle); err == nil || !strings.Contains(err.Error(), "already") {
			t.Errorf("second Handle: %v, want an error saying the channel already has a handler", err)
		}
		if err := r.Handle("nil", nil); err == nil {
			t.Error("Handle with a nil handler succeeded")
		}
	})

	t.Run("nothing refused was sent or stored", func(t *testing.T) {
		if n := storedMessages(t, env.pool); n != 0 {
			t.Errorf("%d messages stored after refusals", n)
		}
		if err := r.Notify(routerCallCtx(t), "jobs", "the first to arrive"); err != nil {
			t.Fatal(err)
		}
		n, err := conn.WaitForNotification(routerCallCtx(t))
		if err != nil {
			t.Fatal(err)
		}
		if n.Channel != "jobs" || n.Payload != "the first to arrive" {
			t.Errorf("received %q on %q before the first valid message: a refused one was sent", n.Payload, n.Channel)
		}
	})

	t.Run("NewRouter checks its arguments without touching the database", func(t *testing.T) {
		if _, err := NewRouter(nil, Options{}); err == nil {
			t.Error("NewRouter with a nil pool succeeded")
		}
		_, err := NewRouter(env.pool, Options{MessageTable: strings.Repeat("t", 64)})
		var oerr *OptionsError
		if !errors.As(err, &oerr) || oerr.Field != "MessageTable" {
			t.Errorf("NewRouter with a 64-byte MessageTable: %v, want an *OptionsError for it", err)
		}
	})
}

func TestRouterDurableDelivery(t *testing.T) {
	t.Parallel()

	t.Run("messages sent while no one leads are delivered in order once a leader serves", func(t *testing.T) {
		t.Parallel()
		env := newRouterEnv(t)
		sender := env.router(t, "sender")
		want := map[string][]string{}
		for i := range 10 {
			for _, channel := range []string{"a", "b"} {
				p := fmt.Sprint(channel, i)
				if err := sender.NotifyDurable(routerCallCtx(t), channel, p); err != nil {
					t.Fatal(err)
				}
				want[channel] = append(want[channel], p)
			}
		}
		// Best-effort messages are dropped: no one listens.
		if err := sender.Notify(routerCallCtx(t), "a", "dropped"); err != nil {
			t.Fatal(err)
		}

		r := env.router(t, "leader")
		box := newInbox()
		for _, channel := range []string{"a", "b"} {
			if err := r.Handle(channel, box.handle); err != nil {
				t.Fatal(err)
			}
		}
		env.lead(t, "late", "leader", r)
		got := box.waitFor(t, 20)
		for _, channel := range []string{"a", "b"} {
			var p []string
			for _, m := range got {
				if m.Channel == channel {
					p = append(p, m.Payload)
					if !m.Durable || m.Attempts != 0 {
						t.Errorf("message %q: Durable %v, Attempts %d", m.Payload, m.Durable, m.Attempts)
					}
				}
			}
			if !slices.Equal(p, want[channel]) {
				t.Errorf("channel %s delivered %q, want %q", channel, p, want[channel])
			}
		}
		waitNoStoredMessages(t, env.pool)
		if n := len(box.messages()); n != 20 {
			t.Errorf("%d messages delivered, want 20", n)
		}
	})

	t.Run("a failing handler is retried in order, later messages waiting, with Attempts counting the failures", func(t *testing.T) {
		t.Parallel()
		env := newRouterEnv(t)
		r := env.router(t, "leader")
		box := newInbox()
		box.fail = func(m Message) error {
			if m.Payload == "3" && m.Attempts < 2 {
				return errors.New("not yet")
			}
			return nil
		}
		if err := r.Handle("retry", box.handle); err != nil {
			t.Fatal(err)
		}
		sender := env.router(t, "sender")
		for i := 1; i <= 5; i++ {
			if err := sender.NotifyDurable(routerCallCtx(t), "retry", fmt.Sprint(i)); err != nil {
				t.Fatal(err)
			}
		}
		env.lead(t, "retry", "leader", r)
		got := box.waitFor(t, 7)
		waitNoStoredMessages(t, env.pool)
		got = box.messages()
		var attempts []int
		for _, m := range got {
			attempts = append(attempts, m.Attempts)
		}
		if p, want := payloads(got), []string{"1", "2", "3", "3", "3", "4", "5"}; !slices.Equal(p, want) {
			t.Errorf("delivered %q, want %q", p, want)
		}
		if want := []int{0, 0, 0, 1, 2, 0, 0}; !slices.Equal(attempts, want) {
			t.Errorf("attempts %v, want %v", attempts, want)
		}
		if got[2].ID != got[3].ID || got[3].ID != got[4].ID {
			t.Errorf("the retried message changed IDs: %d, %d, %d", got[2].ID, got[3].ID, got[4].ID)
		}
	})

	t.Run("NotifyDurableTx delivers only what commits, when it commits, even after a later id", func(t *testing.T) {
		t.Parallel()
		env := newRouterEnv(t)
		r := env.router(t, "leader")
		box := newInbox()
		if err := r.Handle("outbox", box.handle); err != nil {
			t.Fatal(err)
		}
		env.lead(t, "outbox", "leader", r)
		r.waitListening(t)
		sender := env.router(t, "sender")

		rolledBack, err := env.pool.Begin(routerCallCtx(t))
		if err != nil {
			t.Fatal(err)
		}
		if err := sender.NotifyDurableTx(routerCallCtx(t), rolledBack, "outbox", "rolled back"); err != nil {
			t.Fatal(err)
		}
		if err := rolledBack.Rollback(routerCallCtx(t)); err != nil {
			t.Fatal(err)
		}

		// pending gets its id first but commits after "outside" was
		// delivered: it must not be skipped.
		pending, err := env.pool.Begin(routerCallCtx(t))
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = pending.Rollback(context.Background()) }()
		if err := sender.NotifyDurableTx(routerCallCtx(t), pending, "outbox", "committed late"); err != nil {
			t.Fatal(err)
		}
		if err := sender.NotifyDurable(routerCallCtx(t), "outbox", "outside"); err != nil {
			t.Fatal(err)
		}
		if p := payloads(box.waitFor(t, 1)); !slices.Equal(p, []string{"outside"}) {
			t.Fatalf("delivered %q before the commit, want only %q", p, "outside")
		}
		if err := pending.Commit(routerCallCtx(t)); err != nil {
			t.Fatal(err)
		}
		got := box.waitFor(t, 2)
		if p := payloads(got); !slices.Equal(p, []string{"outside", "committed late"}) {
			t.Errorf("delivered %q", p)
		}
		if got[1].ID >= got[0].ID {
			t.Errorf("the late commit has id %d, not below %d: the test did not exercise a late smaller id", got[1].ID, got[0].ID)
		}
		waitNoStoredMessages(t, env.pool)
		if p := payloads(box.messages()); len(p) != 2 {
			t.Errorf("delivered %q; the rolled-back message must never be", p)
		}
	})

	t.Run("a broken connection is re-opened and the messages sent meanwhile are delivered", func(t *testing.T) {
		t.Parallel()
		env := newRouterEnv(t)
		r := env.router(t, "leader")
		box := newInbox()
		if err := r.Handle("reconnect", box.handle); err != nil {
			t.Fatal(err)
		}
		env.lead(t, "reconnect", "leader", r)
		pid := r.waitListening(t)
		sender := env.router(t, "sender")
		sent := 0
		for round := range 3 {
			var terminated bool
			err := pgtest.Shared(t).Admin(t).QueryRow(routerCallCtx(t), "SELECT pg_terminate_backend($1)", int32(pid)).Scan(&terminated)
			if err != nil || !terminated {
				t.Fatalf("terminating Serve's backend %d: %v, %v", pid, terminated, err)
			}
			for i := range 5 { // likely before Serve is back
				if err := sender.NotifyDurable(routerCallCtx(t), "reconnect", fmt.Sprint(round, ".", i)); err != nil {
					t.Fatal(err)
				}
				sent++
			}
			newPID := r.waitListening(t)
			if newPID == pid {
				t.Fatalf("Serve reports the terminated backend %d again", pid)
			}
			pid = newPID
			box.waitFor(t, sent)
			if err := sender.Notify(routerCallCtx(t), "reconnect", fmt.Sprint(round, " best effort")); err != nil {
				t.Fatal(err)
			}
			sent++
			box.waitFor(t, sent)
		}
		waitNoStoredMessages(t, env.pool)
		if n := len(box.messages()); n != sent {
			t.Errorf("%d messages delivered, want %d", n, sent)
		}
	})

	t.Run("a message whose handler returns after leadership ended is still deleted", func(t *testing.T) {
		t.Parallel()
		env := newRouterEnv(t)
		r := env.router(t, "leader")
		handling := make(chan struct{})
		var once sync.Once
		err := r.Handle("slow", func(ctx context.Context, m Message) error {
			once.Do(func() { close(handling) })
			<-ctx.Done() // still working when leadership ends
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		e, _ := env.lead(t, "slow", "leader", r)
		sender := env.router(t, "sender")
		if err := sender.NotifyDurable(routerCallCtx(t), "slow", "one"); err != nil {
			t.Fatal(err)
		}
		select {
		case <-handling:
		case <-time.After(routerWait):
			t.Fatal("the handler was not called")
		}
		if err := e.Resign(routerCallCtx(t)); err != nil {
			t.Fatal(err)
		}
		waitNoStoredMessages(t, env.pool)
	})

	t.Run("a channel without a handler keeps its messages for a leader that handles it", func(t *testing.T) {
		t.Parallel()
		env := newRouterEnv(t)
		sender := env.router(t, "sender")
		if err := sender.NotifyDurable(routerCallCtx(t), "unhandled", "kept"); err != nil {
			t.Fatal(err)
		}
		r := env.router(t, "leader")
		box := newInbox()
		if err := r.Handle("handled", box.handle); err != nil {
			t.Fatal(err)
		}
		env.lead(t, "unhandled", "leader", r)
		if err := sender.NotifyDurable(routerCallCtx(t), "handled", "delivered"); err != nil {
			t.Fatal(err)
		}
		box.waitFor(t, 1)
		electortest.Eventually(t, routerWait, "only the unhandled message to be left", func() bool { return storedMessages(t, env.pool) == 1 })
	})
}

func TestRouterServe(t *testing.T) {
	t.Parallel()

	t.Run("Serve refuses a context that carries no term", func(t *testing.T) {
		t.Parallel()
		env := newRouterEnv(t)
		r := env.router(t, "x")
		for _, ctx := range []context.Context{context.Background(), t.Context()} {
			err := r.Serve(ctx)
			if err == nil || !strings.Contains(err.Error(), "term") || !strings.Contains(err.Error(), "OnElected") {
				t.Errorf("Serve without a term: %v, want an error naming the term and OnElected", err)
			}
		}
	})

	t.Run("Serve returns nil once its context ends, and Handle works again", func(t *testing.T) {
		t.Parallel()
		env := newRouterEnv(t)
		r := env.router(t, "leader")
		if err := r.Handle("a", newInbox().handle); err != nil {
			t.Fatal(err)
		}
		served := make(chan error, 1)
		e, err := leader.New(env.store, leader.Config{
			Name: "serve", ID: "leader", TTL: 2 * time.Second, Logger: routerLogger("leader"),
			OnElected: func(ctx context.Context) { served <- r.Serve(ctx) },
		})
		if err != nil {
			t.Fatal(err)
		}
		stop := electortest.Run(t, e)
		r.waitListening(t)

		// While it runs, a second Serve and Handle are refused.
		err = e.RunIfLeader(routerCallCtx(t), func(ctx context.Context) error { return r.Serve(ctx) })
		if err == nil || !strings.Contains(err.Error(), "already running") {
			t.Errorf("a second Serve: %v, want an error saying Serve is already running", err)
		}
		if err := r.Handle("b", newInbox().handle); err == nil || !strings.Contains(err.Error(), "Serve is running") {
			t.Errorf("Handle while serving: %v, want an error saying Serve is running", err)
		}

		stop() // Run returns only once OnElected, and so Serve, has returned
		select {
		case err := <-served:
			if err != nil {
				t.Errorf("Serve returned %v, want nil", err)
			}
		default:
			t.Fatal("Run returned before Serve did")
		}
		if err := r.Handle("b", newInbox().handle); err != nil {
			t.Errorf("Handle after Serve returned: %v", err)
		}
	})

	t.Run("Serve behind a transaction-pooling proxy returns ErrPooledSession at once, while sending works", func(t *testing.T) {
		t.Parallel()
		url := pgtest.NewDatabase(t)
		direct := pgtest.OpenPool(t, url)
		if err := Migrate(routerCallCtx(t), direct, Options{}); err != nil {
			t.Fatal(err)
		}
		store, err := NewLeaseStore(direct, Options{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(store.Close)
		pooled := pgtest.OpenPool(t, pgtest.PgBouncer(t, url, "transaction"))
		r, err := NewRouter(pooled, Options{Logger: routerLogger("leader")})
		if err != nil {
			t.Fatal(err)
		}
		if err := r.Handle("a", newInbox().handle); err != nil {
			t.Fatal(err)
		}
		// Sending needs no session of its own.
		if err := r.NotifyDurable(routerCallCtx(t), "a", "kept"); err != nil {
			t.Fatal(err)
		}
		if err := r.Notify(routerCallCtx(t), "a", "dropped"); err != nil {
			t.Fatal(err)
		}

		served := make(chan error, 1)
		e, err := leader.New(store, leader.Config{
			Name: "pooled", ID: "leader", TTL: 2 * time.Second, Logger: routerLogger("leader"),
			OnElected: func(ctx context.Context) { served <- r.Serve(ctx) },
		})
		if err != nil {
			t.Fatal(err)
		}
		electortest.Run(t, e)
		select {
		case err := <-served:
			if !errors.Is(err, ErrPooledSession) || !strings.Contains(err.Error(), "the Router") {
				t.Errorf("Serve: %v, want an error wrapping ErrPooledSession that names the Router", err)
			}
		case <-time.After(routerWait):
			t.Fatal("Serve did not return")
		}
		if n := storedMessages(t, direct); n != 1 {
			t.Errorf("%d messages stored, want the 1 sent through the proxy", n)
		}
	})

	t.Run("Serve refuses to run without the message table", func(t *testing.T) {
		t.Parallel()
		env := newRouterEnv(t)
		if _, err := env.pool.Exec(routerCallCtx(t), "DROP TABLE leader_messages"); err != nil {
			t.Fatal(err)
		}
		r := env.router(t, "leader")
		if err := r.Handle("a", newInbox().handle); err != nil {
			t.Fatal(err)
		}
		served := make(chan error, 1)
		e, err := leader.New(env.store, leader.Config{
			Name: "no-table", ID: "leader", TTL: 2 * time.Second, Logger: routerLogger("leader"),
			OnElected: func(ctx context.Context) { served <- r.Serve(ctx) },
		})
		if err != nil {
			t.Fatal(err)
		}
		electortest.Run(t, e)
		select {
		case err := <-served:
			if err == nil || !strings.Contains(err.Error(), "Migrate") {
				t.Errorf("Serve: %v, want an error suggesting Migrate", err)
			}
		case <-time.After(routerWait):
			t.Fatal("Serve did not return")
		}
	})
}
