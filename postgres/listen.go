package postgres

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"

	"github.com/leaderelect/leader"
)

// Timing of the wake-up listener.
const (
	// listenRetryMin and listenRetryMax bound the backoff between attempts
	// to open the listener connection again; it doubles at each failure.
	listenRetryMin = 50 * time.Millisecond
	listenRetryMax = 5 * time.Second
	// listenPingEvery is how long the listener waits for a notification
	// before it checks that its connection still works, so that a
	// connection that died silently is noticed.
	listenPingEvery = 30 * time.Second
	// listenCallTimeout bounds the session check, LISTEN, a ping and
	// closing (connecting takes up to the connect timeout per host, see
	// dialer.within).
	listenCallTimeout = 10 * time.Second
)

// wakeups serves Watch for a store: one dedicated connection that LISTENs
// on Options.Channel and wakes the watchers of the election name in each
// notification's payload.
type wakeups struct {
	dialer  dialer
	channel string
	what    string // who needs the session, for ErrPooledSession
	log     *slog.Logger

	mu       sync.Mutex
	watchers map[string]map[chan struct{}]watcher
	// deferred holds, by name, the wake-up of the free-watchers that a
	// handover to another candidate did not wake (see handover), due
	// when its reservation runs out.
	deferred map[string]*time.Timer
	// covered holds, for the advisory store's lock waiters, whose
	// release notifications not to wake the free-watchers with (see
	// coverage).
	covered map[string]*coverage
	// prepared holds, by name, the handover prepared for a candidate of
	// this store's (see LeaseStore.PrepareHandover): its token, and when
	// the notice came.
	prepared map[string]preparation
	// named holds, by name, the candidate of this store's that the last
	// handover's notice named (see handover): the successor of a
	// ReleaseTo, or the candidate that a plain release wakes first. Its
	// next Acquire tries the grant of a released lease first (see
	// LeaseStore.Acquire). Only kept where keepNamed is set: the lease
	// store's.
	named     map[string]preparation
	keepNamed bool
	// namedFor is how long a mark in named lasts (namedFor, the
	// constant, unless a test lengthens it).
	namedFor time.Duration
	// candidateChannels says whether the listener also LISTENs on the
	// candidate channels of its candidates (see candidateChannel): both
	// PostgreSQL stores', whose plain releases notify the candidate they
	// wake first on its channel alone.
	candidateChannels bool
	// wanted holds the candidate channels of the tokens that free-watchers
	// have watched for (WatchFreeFor), which the listener LISTENs on; it
	// only grows, and holds candidateBuckets at most.
	wanted map[string]struct{}
	// wantedN is len(wanted), which the listener reads without mu.
	wantedN atomic.Int64
	// poke, while the listener waits for a notification, ends that wait,
	// so that it LISTENs on a channel just wanted; nil otherwise. The
	// listener sets it and then reads wantedN; addLocked adds to wantedN
	// and then reads poke: one of them sees the other's write.
	poke    atomic.Pointer[context.CancelFunc]
	closed  bool
	stop    context.CancelFunc // stops the listener; nil until the first Watch
	stopped chan struct{}      // closed when the listener has returned

	// pingEvery is listenPingEvery; tests shorten it.
	pingEvery time.Duration
	// onListen, set only by tests, is called with the listener's backend
	// PID each time LISTEN succeeds, after the watchers were woken.
	onListen func(pid uint32)
	// onWake, set only by tests (under mu), is called under mu with the
	// name and the watcher's token each time wakeNameLocked wakes a
	// free-watcher for a release, a handover or a deferred wake-up (see
	// deferLocked); not for a preparation's notice, nor when the listener
	// (re)connects and wakes every watcher.
	onWake func(name, token string)
}

func newWakeups(d dialer, opts Options, what string) wakeups {
	return wakeups{
		dialer:    d,
		channel:   opts.Channel,
		what:      what,
		log:       opts.Logger.With(slog.String("channel", opts.Channel)),
		watchers:  make(map[string]map[chan struct{}]watcher),
		deferred:  make(map[string]*time.Timer),
		covered:   make(map[string]*coverage),
		prepared:  make(map[string]preparation),
		wanted:    make(map[string]struct{}),
		pingEvery: listenPingEvery,
	}
}

// Watch implements leader.Store. The channel receives a value soon after the
// lease for name is released or granted by any store on the same table and
// channel, and once after the listener connection is (re)established, as a
// notification may have been missed before. Values are coalesced (the
// channel has a buffer of one) and may be spurious. The channel is closed
// after ctx ends.
//
// The first Watch opens the store's listener connection in the background;
// Watch does not wait for it. While the listener cannot LISTEN (the server
// is down, or refuses LISTEN), the channel stays silent. Behind a
// transaction-pooling proxy (see ErrPooledSession) the listener does not
// LISTEN at all, says so in a warning, and the channels stay silent for
// good: followers then wake at the expiry Acquire reported. After Close the
// channels stay silent too, and Watch returns an error wrapping ErrClosed.
func (w *wakeups) Watch(ctx context.Context, name string) (<-chan struct{}, error) {
	return w.watch(ctx, name, watcher{kind: watchAll})
}

// WatchFree implements leader.FreeWatcher: it is Watch without the wake-ups
// for grants.
func (w *wakeups) WatchFree(ctx context.Context, name string) (<-chan struct{}, error) {
	return w.watch(ctx, name, watcher{kind: watchFree})
}

// WatchFreeFor implements leader.HandoverWatcher: it is WatchFree, but a
// handover of the lease to another candidate than c wakes the channel
// only if nobody was granted the lease by the end of the reservation.
func (w *wakeups) WatchFreeFor(ctx context.Context, name string, c leader.Candidate) (<-chan struct{}, error) {
	return w.watch(ctx, name, watcher{kind: watchFree, token: c.Token})
}

// watch registers a watcher of name, of the events that wt says.
func (w *wakeups) watch(ctx context.Context, name string, wt watcher) (<-chan struct{}, error) {
	op := "watch"
	if wt.kind == watchFree {
		op = "watch free"
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("postgres: %s: %w", call(op, name), err)
	}
	ch := make(chan struct{}, 1)
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return nil, fmt.Errorf("postgres: %s: %w", call(op, name), ErrClosed)
	}
	w.addLocked(name, ch, wt)
	if w.stop == nil {
		// The watcher is registered before the listener starts, so the
		// wake-up it sends once listening reaches this watcher, covering
		// events between now and then.
		listenCtx, stop := context.WithCancel(context.Background())
		w.stop, w.stopped = stop, make(chan struct{})
		go w.listen(listenCtx, w.stopped)
	}
	w.mu.Unlock()

	context.AfterFunc(ctx, func() {
		w.mu.Lock()
		defer w.mu.Unlock()
		w.removeLocked(name, ch)
		close(ch) // under mu, so wake never sends on a closed channel
	})
	return ch, nil
}

// watchKind is what wakes a watcher: any event of its name, its releases
// (leader.FreeWatcher), or its grants (an advisory store's lock waiter).
// A wake-up of every watcher (wakeAllLocked, and a name too long for a
// payload) wakes every kind.
type watchKind uint8

const (
	watchAll watchKind = iota
	watchFree
	watchGrants
)

// watcher is a watch channel's kind, and, for a free-watcher of a
// candidate (leader.HandoverWatcher), the candidate's token: a handover
// to another token wakes it only once the reservation has run out
// untaken.
type watcher struct {
	kind  watchKind
	token string
}

// addLocked registers ch as a watcher of name, as wt says. A free-watcher
// of a candidate has the listener LISTEN on that candidate's channel too,
// if the store uses candidate channels.
func (w *wakeups) addLocked(name string, ch chan struct{}, wt watcher) {
	if w.candidateChannels && wt.kind == watchFree && wt.token != "" {
		if c := candidateChannel(w.channel, wt.token); c != "" {
			if _, ok := w.wanted[c]; !ok {
				w.wanted[c] = struct{}{}
				w.wantedN.Add(1)
				if poke := w.poke.Load(); poke != nil {
					(*poke)()
				}
			}
		}
	}
	set := w.watchers[name]
	if set == nil {
		set = make(map[chan struct{}]watcher)
		w.watchers[name] = set
	}
	set[ch] = wt
}

// subscribe registers a channel of the store's own as a watcher of name,
// of the kind given, until the returned function is called. Unlike Watch,
// it does not start the listener.
func (w *wakeups) subscribe(name string, kind watchKind) (<-chan struct{}, func()) {
	ch := make(chan struct{}, 1)
	w.mu.Lock()
	w.addLocked(name, ch, watcher{kind: kind})
	w.mu.Unlock()
	return ch, func() {
		w.mu.Lock()
		w.removeLocked(name, ch)
		w.mu.Unlock()
	}
}

func (w *wakeups) removeLocked(name string, ch chan struct{}) {
	if set := w.watchers[name]; set != nil {
		delete(set, ch)
		if len(set) == 0 {
			delete(w.watchers, name)
			delete(w.named, name) // nobody here campaigns for it any longer
		}
	}
}

// Close stops the wake-up listener and closes its connection, and waits
// until it has. Watchers then stay silent until their contexts end. The
// store's other methods keep working while the pool is open; Close does not
// close the pool. Close may be called more than once.
func (w *wakeups) Close() {
	w.mu.Lock()
	w.closed = true
	stop, stopped := w.stop, w.stopped
	for name, t := range w.deferred {
		t.Stop()
		delete(w.deferred, name)
	}
	w.mu.Unlock()
	if stop != nil {
		stop()
		<-stopped
	}
}

// notified wakes the watchers of the notification payload (see
// parsePayload), sent by the backend of PID pid on the store's channel
// (targeted false) or on one of its candidate channels (true): a
// candidate channel's, from a plain release that names the candidate to
// wake first, wakes it even where a lock waiter covers the holder's
// releases (see coverage), whose mark that release frees later.
func (w *wakeups) notified(payload string, pid uint32, targeted bool) {
	n := parsePayload(payload)
	w.mu.Lock()
	defer w.mu.Unlock()
	if n.name == "" {
		w.wakeAllLocked()
		return
	}
	if c := w.covered[n.name]; c != nil && pid != 0 && n.ev != eventPrepare && !targeted {
		granted := n.ev == eventGrant
		switch {
		case granted && pid == c.gone:
			// The holder that went holds again: its next release is
			// not the one the lock waiter saw.
			c.gone = 0
		case !granted && pid == c.waiting:
			// The lock waiter waits on this holder's mark, and will
			// wake the free-watchers when the holder lets go of it:
			// waking them now would cost each follower a second attempt.
			n.ev = eventCovered
		case !granted && pid == c.gone:
			// The release of the holder that the lock waiter saw go,
			// and has woken the free-watchers for.
			n.ev = eventCovered
		}
	}
	w.wakeNameLocked(n)
}

// wake wakes the watchers of name's releases, and of all its events: its
// lease may have become free. (It does not wake the watchers of grants
// alone, the lock waiter that calls it.)
func (w *wakeups) wake(name string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.wakeNameLocked(notice{name: name, ev: eventRelease})
}

// handover is wake for a lease released to the candidate whose token is
// token, reserved for it for hold: it wakes the free-watchers of other
// candidates (leader.HandoverWatcher) only once hold has passed, unless a
// grant of the name comes first.
func (w *wakeups) handover(name, token string, hold time.Duration) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.wakeNameLocked(notice{name: name, ev: eventHandover, token: token, hold: hold})
}

// coverage is, for a name of the advisory store, what its lock waiter
// does for notified: the backend PID of the holder whose mark it waits on
// (waiting; 0 if none), and of the last holder it saw go (gone). A release
// notification from either does not wake the free-watchers
// (leader.FreeWatcher): the lock waiter does, as the holder lets go of its
// mark, and each follower is woken once per handover.
type coverage struct {
	waiting, gone uint32
}

// expect tells notified that name's lock waiter is about to wait on the
// mark of the holder of backend pid.
func (w *wakeups) expect(name string, pid uint32) {
	w.mu.Lock()
	defer w.mu.Unlock()
	c := w.covered[name]
	if c == nil {
		c = &coverage{}
		w.covered[name] = c
	}
	c.waiting = pid
}

// settle ends expect: if sawGo, the lock waiter saw the holder go and
// wakes every watcher now.
func (w *wakeups) settle(name string, sawGo bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	c := w.covered[name]
	if c == nil {
		return
	}
	if sawGo {
		c.gone = c.waiting
	}
	c.waiting = 0
}

// uncover forgets name's lock waiter, which has stopped.
func (w *wakeups) uncover(name string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	delete(w.covered, name)
}

// event is what happened to a name, for wakeNameLocked.
type event uint8

const (
	eventRelease event = iota // or the lease may have become free
	eventGrant
	// eventHandover is a release reserved for a successor (see
	// handover).
	eventHandover
	// eventCovered is a release that name's lock waiter covers (see
	// coverage): it wakes only the watchers of every event.
	eventCovered
	// eventPrepare is a handover prepared for the candidate of token
	// (see LeaseStore.PrepareHandover): it wakes that candidate's
	// free-watchers alone, so that it tries, and waits for the handover.
	eventPrepare
)

// preparation is a handover prepared for a candidate whose token is
// token, as a notice told it at at.
type preparation struct {
	token string
	at    time.Time
}

// takePrepared reports whether a handover of name was prepared for the
// candidate of token less than preparedFor ago, and forgets it.
func (w *wakeups) takePrepared(name, token string) bool {
	_, ok := w.takePreparedAt(name, token)
	return ok
}

// takePreparedAt is takePrepared, and returns when the notice told of the
// preparation, for putBackPrepared.
func (w *wakeups) takePreparedAt(name, token string) (at time.Time, ok bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	p, ok := w.prepared[name]
	if !ok || p.token != token {
		return time.Time{}, false
	}
	delete(w.prepared, name)
	return p.at, time.Since(p.at) < preparedFor
}

// putBackPrepared records again a preparation of name for the candidate
// of token that a notice told of at, and that takePreparedAt took, unless
// a notice has told of another since: an Acquire that took it and failed
// (its context ended) leaves it to the candidate's next one.
func (w *wakeups) putBackPrepared(name, token string, at time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if _, ok := w.prepared[name]; ok {
		return
	}
	if w.prepared == nil {
		w.prepared = make(map[string]preparation)
	}
	w.prepared[name] = preparation{token: token, at: at}
}

// namedFor is how long after a handover's notice that named a candidate
// its Acquire tries the grant of a released lease first: an Acquire later
// than that is an ordinary one.
const namedFor = time.Second

// takeNamed reports whether a handover's notice named the candidate of
// token for name less than namedFor ago, and forgets it.
func (w *wakeups) takeNamed(name, token string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	p, ok := w.named[name]
	if !ok || p.token != token {
		return false
	}
	delete(w.named, name)
	d := w.namedFor
	if d == 0 {
		d = namedFor
	}
	return time.Since(p.at) < d
}

// PreparedFor implements leader.PreparedForChecker: it reports whether a
// notice told this store, less than preparedFor ago, that a handover of
// name was prepared for c (see LeaseStore.PrepareHandover and
// AdvisoryStore.PrepareHandover), and c's next Acquire has not taken it
// yet.
func (w *wakeups) PreparedFor(name string, c leader.Candidate) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	p, ok := w.prepared[name]
	return ok && p.token == c.Token && time.Since(p.at) < preparedFor
}

// notice is an event of a name, and for a handover, the successor's
// token and how long the lease is reserved for it.
type notice struct {
	name  string
	ev    event
	token string
	hold  time.Duration
}

// wakeNameLocked wakes the watchers of n.name that n concerns. A handover
// leaves the free-watchers of other candidates than its successor to a
// wake-up due when its reservation runs out (see deferLocked); a grant
// or a release calls that off.
func (w *wakeups) wakeNameLocked(n notice) {
	if n.ev == eventPrepare {
		if w.prepared == nil {
			w.prepared = make(map[string]preparation)
		}
		w.prepared[n.name] = preparation{token: n.token, at: time.Now()}
		for ch, wt := range w.watchers[n.name] {
			if wt.kind == watchFree && wt.token == n.token {
				notify(ch)
			}
		}
		return
	}
	if n.ev == eventGrant {
		delete(w.named, n.name)
	}
	later := false
	for ch, wt := range w.watchers[n.name] {
		switch {
		case wt.kind == watchAll:
		case wt.kind == watchFree && n.ev == eventRelease:
		case wt.kind == watchFree && n.ev == eventHandover:
			if wt.token != "" && wt.token != n.token {
				later = true
				continue
			}
			if w.keepNamed && wt.token == n.token {
				if w.named == nil {
					w.named = make(map[string]preparation)
				}
				w.named[n.name] = preparation{token: n.token, at: time.Now()}
			}
		case wt.kind == watchGrants && n.ev == eventGrant:
		default:
			continue
		}
		if w.onWake != nil && wt.kind == watchFree {
			w.onWake(n.name, wt.token)
		}
		notify(ch)
	}
	switch {
	case later:
		w.deferLocked(n.name, n.hold)
	case n.ev == eventGrant || n.ev == eventRelease:
		w.undeferLocked(n.name)
	}
}

// taken tells the wake-ups that name's lease was found taken by a new
// holder (see AdvisoryStore.wakeFor): a deferred wake-up of its
// free-watchers (see deferLocked) would only have them try in vain.
func (w *wakeups) taken(name string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.undeferLocked(name)
}

// undeferLocked cancels the deferred wake-up of name's free-watchers, if
// any (see deferLocked). The caller holds mu.
func (w *wakeups) undeferLocked(name string) {
	if t := w.deferred[name]; t != nil {
		t.Stop()
		delete(w.deferred, name)
	}
}

// deferLocked wakes the free-watchers of name once d has passed (a
// little more, for the rounding of the reservation and the rate of the
// clocks), unless a grant or a release of name comes first.
func (w *wakeups) deferLocked(name string, d time.Duration) {
	if t := w.deferred[name]; t != nil {
		t.Stop()
	}
	var t *time.Timer
	t = time.AfterFunc(d+deferSlack, func() {
		w.mu.Lock()
		defer w.mu.Unlock()
		if w.closed || w.deferred[name] != t {
			return
		}
		delete(w.deferred, name)
		w.wakeNameLocked(notice{name: name, ev: eventRelease})
	})
	w.deferred[name] = t
}

// deferSlack is how long after a reservation ran out, as a handover's
// notice said, the free-watchers that it did not wake are woken.
const deferSlack = 5 * time.Millisecond

// dibsHold is how long a plain release's notice asks the candidates other
// than the one it names to hold off (see dibsPayload): they are woken
// dibsHold and deferSlack after it, unless the notice of a grant comes
// first, which the new holder's store sends noticeDelay after its grant.
// So a campaigning candidate takes a released lease alone, without the
// others' attempts competing with its own for the server and the CPU; a
// named candidate that has stopped costs a handover this much.
const dibsHold = 3 * time.Millisecond

// notify sends a value on ch unless one is pending already.
func notify(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default: // a value is pending already; coalesce
	}
}

// The stores' NOTIFY payloads: a release of name is sent as name itself
// (releaseEvent), or as "~r" followed by name if name begins with '~'; a
// grant as "~g" followed by name (grantEvent); a handover as "~h", the
// reservation's length in microseconds, ",", the length in bytes of the
// successor's token, ":", the token, and name. A payload too long is
// sent as the release's, and a name too long for that as the empty
// payload, which wakes every watcher. A prepared handover's notice
// (LeaseStore.PrepareHandover) is "~p", the length in bytes of the
// successor's token, ":", the token, and name; it is not sent when too
// long. (A store of a version before it takes it for the release of a
// name that begins with "~p", a wake-up of nobody.)
const (
	payloadGrant    = "~g"
	payloadRelease  = "~r"
	payloadHandover = "~h"
	payloadPrepare  = "~p"
)

// parsePayload returns the notice of a NOTIFY payload; its name is empty
// for the empty payload. A handover's payload that does not parse is
// taken for a release of the name it would be.
func parsePayload(payload string) notice {
	switch {
	case strings.HasPrefix(payload, payloadGrant):
		return notice{name: payload[len(payloadGrant):], ev: eventGrant}
	case strings.HasPrefix(payload, payloadRelease):
		return notice{name: payload[len(payloadRelease):], ev: eventRelease}
	case strings.HasPrefix(payload, payloadHandover):
		if n, ok := parseHandover(payload[len(payloadHandover):]); ok {
			return n
		}
		return notice{name: payload, ev: eventRelease}
	case strings.HasPrefix(payload, payloadPrepare):
		if n, ok := parsePrepare(payload[len(payloadPrepare):]); ok {
			return n
		}
		return notice{name: payload, ev: eventRelease}
	default:
		return notice{name: payload, ev: eventRelease}
	}
}

// parseHandover parses the rest of a handover's payload, after its
// marker.
func parseHandover(p string) (notice, bool) {
	us, rest, ok := strings.Cut(p, ",")
	if !ok {
		return notice{}, false
	}
	n, rest, ok := strings.Cut(rest, ":")
	if !ok {
		return notice{}, false
	}
	hold, err1 := strconv.ParseInt(us, 10, 64)
	size, err2 := strconv.Atoi(n)
	if err1 != nil || err2 != nil || hold < 0 || size <= 0 || size >= len(rest) {
		return notice{}, false
	}
	return notice{name: rest[size:], ev: eventHandover, token: rest[:size], hold: time.Duration(hold) * time.Microsecond}, true
}

// parsePrepare parses the rest of a prepared handover's payload, after
// its marker.
func parsePrepare(p string) (notice, bool) {
	n, rest, ok := strings.Cut(p, ":")
	if !ok {
		return notice{}, false
	}
	size, err := strconv.Atoi(n)
	if err != nil || size <= 0 || size >= len(rest) {
		return notice{}, false
	}
	return notice{name: rest[size:], ev: eventPrepare, token: rest[:size]}, true
}

func (w *wakeups) wakeAllLocked() {
	for _, set := range w.watchers {
		for ch := range set {
			notify(ch)
		}
	}
}

// listen keeps a listener connection open until ctx ends, opening it again
// with backoff whenever it fails, and closes stopped when it returns.
func (w *wakeups) listen(ctx context.Context, stopped chan<- struct{}) {
	defer close(stopped)
	loop := sessionLoop[*pgx.Conn]{
		connect: func(ctx context.Context) (*pgx.Conn, error) {
			config := w.dialer.connConfig()
			// A wait for notifications ends by a deadline, never by a
			// cancel request, which could hit the LISTEN after it.
			config.BuildContextWatcherHandler = deadlineWatcher
			conn, err := w.dialer.connect(ctx, config)
			if err != nil {
				return nil, fmt.Errorf("connecting: %w", err)
			}
			return conn, nil
		},
		serve:    w.listenOnce,
		retryMin: listenRetryMin,
		retryMax: listenRetryMax,
		log:      w.log,
		lost:     "wake-up listener lost; watchers are silent until it is back",
		back:     "wake-up listener is back",
	}
	if err := loop.run(ctx); err != nil {
		// ErrPooledSession, the loop's only permanent error here.
		w.log.Warn("store wake-ups are off: LISTEN does not work through a transaction-pooling proxy; followers will try at the lease's expiry instead",
			slog.Any("error", err))
	}
}

// listenOnce LISTENs on conn (on the store's channel, and on the
// candidate channels wanted), wakes every watcher, and passes
// notifications on until the connection fails or ctx ends. It calls ready
// once LISTEN has succeeded, and returns why it stopped. A candidate
// channel wanted later is LISTENed on as the wait for notifications is
// poked (see addLocked).
func (w *wakeups) listenOnce(ctx context.Context, conn *pgx.Conn, ready func()) error {
	callCtx, cancel := context.WithTimeout(ctx, listenCallTimeout)
	err := checkSession(callCtx, conn, w.what)
	if err == nil {
		_, err = conn.Exec(callCtx, "LISTEN "+pgx.Identifier{w.channel}.Sanitize())
	}
	cancel()
	if err != nil {
		return fmt.Errorf("LISTEN: %w", err)
	}
	listening := map[string]struct{}{}
	if err := w.listenWanted(ctx, conn, listening); err != nil {
		return err
	}
	ready()
	// Notifications sent before LISTEN took effect were missed: wake
	// everyone so that followers look now instead of at the expiry.
	w.mu.Lock()
	w.wakeAllLocked()
	w.mu.Unlock()
	if w.onListen != nil {
		w.onListen(conn.PgConn().PID())
	}

	for {
		waitCtx, cancel := context.WithTimeout(ctx, w.pingEvery)
		if w.candidateChannels {
			w.poke.Store(&cancel)
			if w.wantedN.Load() > int64(len(listening)) {
				// A candidate channel wanted meanwhile: LISTEN on it
				// first.
				w.poke.Store(nil)
				cancel()
				if err := w.listenWanted(ctx, conn, listening); err != nil {
					return err
				}
				continue
			}
		}
		n, err := conn.WaitForNotification(waitCtx)
		if w.candidateChannels {
			w.poke.Store(nil)
		}
		poked := errors.Is(err, context.Canceled) && waitCtx.Err() != nil && ctx.Err() == nil
		cancel()
		switch {
		case err == nil:
			w.notified(n.Payload, n.PID, n.Channel != w.channel)
		case ctx.Err() != nil:
			return ctx.Err()
		case poked && !conn.IsClosed():
			// Poked: the loop LISTENs on the channel wanted.
		case errors.Is(err, context.DeadlineExceeded) && !conn.IsClosed():
			// Quiet for a while: make sure the connection still works.
			pingCtx, cancel := context.WithTimeout(ctx, listenCallTimeout)
			err := conn.Ping(pingCtx)
			cancel()
			if err != nil {
				return fmt.Errorf("ping: %w", err)
			}
		default:
			return fmt.Errorf("waiting for notifications: %w", err)
		}
	}
}

// deadlineWatcher is a pgx.ConnConfig's BuildContextWatcherHandler that
// ends a call whose context ends by the connection's deadline alone.
func deadlineWatcher(c *pgconn.PgConn) ctxwatch.Handler {
	return &pgconn.DeadlineContextWatcherHandler{Conn: c.Conn()}
}

// listenWanted LISTENs on conn on the candidate channels wanted that are
// not in listening yet, in one round trip, and adds them to it.
func (w *wakeups) listenWanted(ctx context.Context, conn *pgx.Conn, listening map[string]struct{}) error {
	var sql strings.Builder
	var added []string
	w.mu.Lock()
	for c := range w.wanted {
		if _, ok := listening[c]; !ok {
			sql.WriteString("LISTEN " + pgx.Identifier{c}.Sanitize() + ";")
			added = append(added, c)
		}
	}
	w.mu.Unlock()
	if len(added) == 0 {
		return nil
	}
	callCtx, cancel := context.WithTimeout(ctx, listenCallTimeout)
	defer cancel()
	if _, err := conn.Exec(callCtx, sql.String(), pgx.QueryExecModeSimpleProtocol); err != nil {
		return fmt.Errorf("LISTEN on candidate channels: %w", err)
	}
	for _, c := range added {
		listening[c] = struct{}{}
	}
	return nil
}
