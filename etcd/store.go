package etcd

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"
	"unicode/utf8"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leaderelect/leader"
)

// Default option values.
const (
	// DefaultPrefix is the prefix of every key a Store writes unless
	// WithPrefix says otherwise.
	DefaultPrefix = "leader/"
	// DefaultCallTimeout bounds each call whose context has no deadline
	// unless WithCallTimeout says otherwise.
	DefaultCallTimeout = 30 * time.Second
)

// ErrClosed is returned (wrapped) by every method of a Store after Close.
// From Renew, RenewBatch, Release and ReleaseTo it comes with
// leader.ErrLeaseLost: a closed Store keeps no lease alive, so an Elector
// still leading on it steps down at its next renewal.
var ErrClosed = errors.New("etcd: store closed")

// Option configures New.
type Option func(*options)

type options struct {
	prefix      string
	callTimeout time.Duration
	logger      *slog.Logger
}

// WithPrefix sets the prefix of every key the Store reads and writes
// (see "Key layout" in the package documentation). Every Store that takes
// part in the elections of one name must use the same prefix; Stores with
// different prefixes never see each other's names. Default DefaultPrefix
// ("leader/"). Not empty, at most 256 bytes, valid UTF-8.
func WithPrefix(prefix string) Option {
	return func(o *options) { o.prefix = prefix }
}

// WithCallTimeout bounds each call whose context has no deadline
// (context.Background(), say), so that every call ends even when etcd
// never answers; it is then reported as leader.ErrUnavailable. Electors
// give every call a deadline of their own. Default DefaultCallTimeout
// (30s); more than 0.
func WithCallTimeout(d time.Duration) Option {
	return func(o *options) { o.callTimeout = d }
}

// WithLogger sets where the Store reports problems of its background
// work: a watch that etcd ended, a holder key whose expiry could not be
// written. Default: discard.
func WithLogger(l *slog.Logger) Option {
	return func(o *options) { o.logger = l }
}

// OptionError reports an option that breaks a rule. New returns it before
// touching etcd.
type OptionError struct {
	Option string // the option, for example "WithPrefix"
	Value  string // the value given
	Rule   string // the rule broken, for example "must not be empty"
}

// Error says which option breaks which rule, and its value.
func (e *OptionError) Error() string {
	return fmt.Sprintf("etcd: invalid %s(%q): %s", e.Option, e.Value, e.Rule)
}

// Store is a leader.Store on etcd. It also implements leader.FreeWatcher,
// leader.BatchRenewer, leader.LossNotifier and leader.Transferer. Create
// one with New; its methods are safe for concurrent use, and one Store
// serves any number of Electors and names. Close it when done.
type Store struct {
	client      *clientv3.Client
	prefix      string
	callTimeout time.Duration
	log         *slog.Logger

	bg   context.Context // ended by Close
	stop context.CancelFunc
	wg   sync.WaitGroup // background goroutines: watches, expiries
	// leaseSem is a semaphore of one, held while granting a lease, so
	// that concurrent calls share one. Waiters select on their own
	// context, so none waits past it for another call's grant.
	leaseSem chan struct{}

	mu      sync.Mutex
	closed  bool
	held    map[string]*held       // name → the grant this Store made and keeps alive
	leases  map[int64]*holderLease // lease TTL in seconds → the shared holder lease
	softs   map[int64]*softLease   // lease TTL in seconds → the lease of soft state
	watches map[string]*nameWatch  // name → its etcd watch and local watchers
}

var (
	_ leader.Store        = (*Store)(nil)
	_ leader.FreeWatcher  = (*Store)(nil)
	_ leader.BatchRenewer = (*Store)(nil)
	_ leader.LossNotifier = (*Store)(nil)
	_ leader.Transferer   = (*Store)(nil)
)

// New returns a Store on client. It checks its options and starts nothing:
// leases are granted, and watches started, as calls need them. The client
// stays the caller's: close it after the Store.
func New(client *clientv3.Client, opts ...Option) (*Store, error) {
	o := options{prefix: DefaultPrefix, callTimeout: DefaultCallTimeout}
	for _, opt := range opts {
		opt(&o)
	}
	switch {
	case client == nil:
		return nil, errors.New("etcd: New: the client is nil")
	case o.prefix == "":
		return nil, &OptionError{Option: "WithPrefix", Value: o.prefix, Rule: "must not be empty (the Store's keys would mix with every other key)"}
	case len(o.prefix) > 256:
		return nil, &OptionError{Option: "WithPrefix", Value: o.prefix, Rule: fmt.Sprintf("must be at most 256 bytes, is %d", len(o.prefix))}
	case !utf8.ValidString(o.prefix):
		return nil, &OptionError{Option: "WithPrefix", Value: o.prefix, Rule: "must be valid UTF-8"}
	case o.callTimeout <= 0:
		return nil, &OptionError{Option: "WithCallTimeout", Value: o.callTimeout.String(), Rule: "must be more than 0"}
	}
	if o.logger == nil {
		o.logger = slog.New(slog.DiscardHandler)
	}
	bg, stop := context.WithCancel(context.Background())
	return &Store{
		client:      client,
		prefix:      o.prefix,
		callTimeout: o.callTimeout,
		log:         o.logger,
		bg:          bg,
		stop:        stop,
		held:        make(map[string]*held),
		leases:      make(map[int64]*holderLease),
		softs:       make(map[int64]*softLease),
		watches:     make(map[string]*nameWatch),
		leaseSem:    make(chan struct{}, 1),
	}, nil
}

// Prefix returns the prefix of the Store's keys.
func (s *Store) Prefix() string { return s.prefix }

// Close stops the Store's background work (watches, expiries, reads that
// settle writes of unknown outcome) and closes its watch channels. It
// neither releases nor revokes anything: a lease still held through the
// Store is no longer kept alive, so etcd ends it within its lease TTL
// (see Expiry in the package documentation), as it would if the process
// had died. Stop the Electors that use the Store first: their Run
// releases. Closing twice is harmless.
func (s *Store) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.stop()
	for _, h := range s.held {
		h.timer.Stop()
	}
	s.held = map[string]*held{}
	for _, w := range s.watches {
		w.closeLocked()
	}
	s.watches = map[string]*nameWatch{}
	s.mu.Unlock()
	s.wg.Wait()
	return nil
}

// begin starts a call: it returns the cause (ctx's error, or ErrClosed)
// if ctx has ended or the Store is closed, and otherwise the context for
// the call's requests, bounded by the call timeout when ctx has no
// deadline and ended by Close.
func (s *Store) begin(ctx context.Context) (context.Context, context.CancelFunc, error) {
	if err := ctx.Err(); err != nil {
		return nil, nil, err
	}
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	if closed {
		return nil, nil, ErrClosed
	}
	var cancel context.CancelFunc
	if _, ok := ctx.Deadline(); ok {
		ctx, cancel = context.WithCancel(ctx)
	} else {
		ctx, cancel = context.WithTimeout(ctx, s.callTimeout)
	}
	stop := context.AfterFunc(s.bg, cancel)
	return ctx, func() { stop(); cancel() }, nil
}

func call(op, name string) string { return fmt.Sprintf("%s %q", op, name) }
