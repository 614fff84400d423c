package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"go.uber.org/zap"
	"k8s.io/client-go/tools/leaderelection"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/bench/internal/pglock"
	"github.com/leaderelect/leader/bench/internal/skill"
	etcdstore "github.com/leaderelect/leader/etcd"
	"github.com/leaderelect/leader/postgres"
)

// newBackend returns the shared part of spec's kind, for a child process.
func newBackend(ctx context.Context, spec childSpec, logger *slog.Logger) (*backend, error) {
	switch spec.Kind {
	case kindLease, kindAdvisory:
		return oursBackend(ctx, spec, logger)
	case kindSkill:
		return skillBackend(spec, logger)
	case kindClientGo:
		return clientGoBackend(spec)
	case kindEtcd:
		return etcdBackend(spec)
	case kindLeaderEtcd:
		return leaderEtcdBackend(spec, logger)
	}
	return nil, fmt.Errorf("unknown kind %q", spec.Kind)
}

// tracedPool opens a pool whose connections count their statements.
func tracedPool(connString string) (*pgxpool.Pool, *statementCounter, error) {
	cfg, err := pgxpool.ParseConfig(connString)
	if err != nil {
		return nil, nil, err
	}
	counter := &statementCounter{}
	cfg.ConnConfig.Tracer = counter
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		return nil, nil, err
	}
	return pool, counter, nil
}

func pingPool(pool *pgxpool.Pool) func() error {
	return func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		return pool.Ping(ctx)
	}
}

// goCandidate runs a blocking campaign function on a goroutine; stop
// cancels its context and waits for it to return.
type goCandidate struct {
	run    func(ctx context.Context)
	cancel context.CancelFunc
	done   chan struct{}
}

func (c *goCandidate) start() {
	ctx, cancel := context.WithCancel(context.Background())
	c.cancel, c.done = cancel, make(chan struct{})
	go func() {
		defer close(c.done)
		c.run(ctx)
	}()
}

func (c *goCandidate) stop() {
	c.cancel()
	<-c.done
}

// --- ours: leader.Elector on the lease or advisory store ---

func oursBackend(ctx context.Context, spec childSpec, logger *slog.Logger) (*backend, error) {
	pool, counter, err := tracedPool(spec.ConnString)
	if err != nil {
		return nil, err
	}
	opts := postgres.Options{Logger: logger}
	var (
		store leader.Store
		close func()
	)
	if spec.Kind == kindLease {
		s, err := postgres.NewLeaseStore(pool, opts)
		if err != nil {
			pool.Close()
			return nil, err
		}
		store, close = s, s.Close
	} else {
		s, err := postgres.NewAdvisoryStore(ctx, pool, opts)
		if err != nil {
			pool.Close()
			return nil, err
		}
		store, close = s, s.Close
	}
	acquires := new(atomic.Int64)
	return &backend{
		newCandidate: electorCandidates(store, spec, logger, acquires),
		counts:       counter.snapshot,
		acquires:     acquires.Load,
		warmUp:       pingPool(pool),
		close:        func() { close(); pool.Close() },
	}, nil
}

// electorCandidates returns a backend's newCandidate for ours: an Elector
// of spec's election on store (wrapped by readyStore, which counts its
// Acquire calls in acquires).
func electorCandidates(store leader.Store, spec childSpec, logger *slog.Logger, acquires *atomic.Int64) func(id string, h hooks) (candidate, error) {
	return func(id string, h hooks) (candidate, error) {
		var e *leader.Elector
		e, err := leader.New(readyStore(store, h, acquires), leader.Config{
			Name:           spec.Name,
			ID:             id,
			TTL:            spec.Timing.TTL.D(),
			RenewInterval:  spec.Timing.Renew.D(),
			Priority:       spec.Priority,
			HandOverOnStop: spec.HandOverOnStop,
			Logger:         logger.With(slog.String("id", id)),
			OnElected: func(ctx context.Context) {
				term, _ := leader.TermFrom(ctx)
				h.elected(term, string(e.Status().Reason))
			},
			OnDemoted: h.demoted,
		})
		if err != nil {
			return nil, err
		}
		return &electorCandidate{e: e, goCandidate: goCandidate{run: func(ctx context.Context) {
			if err := e.Run(ctx); err != nil {
				logger.Error("Run", slog.Any("error", err))
			}
		}}}, nil
	}
}

// --- ours: leader.Elector on the etcd store ---

// leaderEtcdBackend is ours on etcd: one client (its gRPC requests counted
// as the etcd kind counts them) and one etcd.Store per process, under a
// key prefix of the setup's own (spec.EtcdPrefix), on the same embedded
// server as etcd's election. The store keeps each name on an etcd lease
// of ceil(TTL) seconds, at least the server's minimum (2s).
func leaderEtcdBackend(spec childSpec, logger *slog.Logger) (*backend, error) {
	cli, counter, err := countedEtcdClient(spec)
	if err != nil {
		return nil, err
	}
	prefix := spec.EtcdPrefix
	if prefix == "" {
		prefix = "/leaderbench-ours/"
	}
	store, err := etcdstore.New(cli, etcdstore.WithPrefix(prefix), etcdstore.WithLogger(logger))
	if err != nil {
		cli.Close()
		return nil, err
	}
	acquires := new(atomic.Int64)
	return &backend{
		newCandidate: electorCandidates(store, spec, logger, acquires),
		counts:       counter.snapshot,
		acquires:     acquires.Load,
		warmUp: func() error {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_, err := cli.Get(ctx, prefix+"warm-up")
			return err
		},
		close: func() { store.Close(); cli.Close() },
	}, nil
}

// leaderEtcdPrefix is the key prefix of our etcd store in setup (each
// setup has one of its own, as each PostgreSQL setup has a database).
func leaderEtcdPrefix(setup string) string { return "/leaderbench-ours/" + setup + "/" }

// electorCandidate is a campaign of ours: it can hand its leadership over.
type electorCandidate struct {
	goCandidate
	e *leader.Elector
}

func (c *electorCandidate) transfer(ctx context.Context, to string) (leader.Lease, error) {
	return c.e.Transfer(ctx, to)
}

// readyStore wraps store to call h.ready when the first Acquire returns (so
// that readiness costs the Elector nothing: no OnNewLeader goroutine), and
// h.enlisted after each Enlist that succeeds and each Acquire that is
// answered without a grant (which enlists, see leader.Transferer), and to
// count Acquire calls in calls. It keeps the store's LossNotifier,
// Transferer and HandoverPreparer, which the Elector looks for.
func readyStore(store leader.Store, h hooks, calls *atomic.Int64) leader.Store {
	w := &acquireHook{Store: store, ready: h.ready, calls: calls}
	ln, loss := store.(leader.LossNotifier)
	ts, transfers := store.(leader.Transferer)
	var th *transferHook
	if transfers {
		th = &transferHook{Transferer: ts, enlisted: h.enlisted}
		w.enlisted = h.enlisted
	}
	hp, prepares := store.(leader.HandoverPreparer)
	prepares = prepares && os.Getenv(envNoPrepare) == ""
	var ph *prepareHook
	if prepares {
		ph = &prepareHook{hp}
	}
	switch {
	case loss && transfers && prepares:
		return &struct {
			*acquireHook
			leader.LossNotifier
			*transferHook
			*prepareHook
		}{w, ln, th, ph}
	case transfers && prepares:
		return &struct {
			*acquireHook
			*transferHook
			*prepareHook
		}{w, th, ph}
	case loss && transfers:
		return &struct {
			*acquireHook
			leader.LossNotifier
			*transferHook
		}{w, ln, th}
	case loss:
		return &struct {
			*acquireHook
			leader.LossNotifier
		}{w, ln}
	case transfers:
		return &struct {
			*acquireHook
			*transferHook
		}{w, th}
	}
	return w
}

type acquireHook struct {
	leader.Store
	once     sync.Once
	ready    func()
	enlisted func() // nil unless the store is a leader.Transferer
	calls    *atomic.Int64
}

func (s *acquireHook) Acquire(ctx context.Context, name string, c leader.Candidate, ttl time.Duration) (leader.Lease, bool, error) {
	s.calls.Add(1)
	tracef("acquire start")
	l, ok, err := s.Store.Acquire(ctx, name, c, ttl)
	tracef("acquire end ok=%v err=%v", ok, err)
	if err == nil {
		s.once.Do(s.ready)
		if !ok && s.enlisted != nil {
			s.enlisted()
		}
	}
	return l, ok, err
}

// Release traces the call (see envTrace).
func (s *acquireHook) Release(ctx context.Context, name, token string, term uint64) error {
	tracef("release start")
	err := s.Store.Release(ctx, name, token, term)
	tracef("release end err=%v", err)
	return err
}

// WatchFree passes on the store's leader.FreeWatcher, so that the Elector
// watches as it would on the store itself.
func (s *acquireHook) WatchFree(ctx context.Context, name string) (<-chan struct{}, error) {
	if fw, ok := s.Store.(leader.FreeWatcher); ok {
		return fw.WatchFree(ctx, name)
	}
	return s.Store.Watch(ctx, name)
}

// WatchFreeFor passes on the store's leader.HandoverWatcher, or its
// WatchFree (the same, less the wake-ups that a handover saves), so that
// the Elector watches as it would on the store itself.
func (s *acquireHook) WatchFreeFor(ctx context.Context, name string, c leader.Candidate) (<-chan struct{}, error) {
	if hw, ok := s.Store.(leader.HandoverWatcher); ok {
		return hw.WatchFreeFor(ctx, name, c)
	}
	return s.WatchFree(ctx, name)
}

// transferHook passes on the store's leader.Transferer, calling enlisted
// (if not nil) after each Enlist that succeeds, and tracing ReleaseTo.
type transferHook struct {
	leader.Transferer
	enlisted func()
}

func (s *transferHook) Enlist(ctx context.Context, name string, c leader.Candidate, ttl time.Duration) error {
	err := s.Transferer.Enlist(ctx, name, c, ttl)
	if err == nil && s.enlisted != nil {
		s.enlisted()
	}
	return err
}

// ReleaseTo traces the call (see envTrace).
func (s *transferHook) ReleaseTo(ctx context.Context, name, token string, term uint64, successor leader.Candidate, reason leader.GrantReason, hold time.Duration) error {
	tracef("release-to %s start", successor.ID)
	err := s.Transferer.ReleaseTo(ctx, name, token, term, successor, reason, hold)
	tracef("release-to end err=%v", err)
	return err
}

// envNoPrepare, when set in the bench's environment (the children
// inherit it), hides the store's leader.HandoverPreparer from the
// Electors, which then hand over with ReleaseTo: an A/B comparison of
// prepared handovers on one machine.
const envNoPrepare = "LEADERBENCH_NO_PREPARE"

// prepareHook passes on the store's leader.HandoverPreparer, tracing the
// preparation and its Commit (see envTrace).
type prepareHook struct {
	hp leader.HandoverPreparer
}

func (s *prepareHook) PrepareHandover(ctx context.Context, name, token string, term uint64, successor leader.Candidate, wait time.Duration) (leader.PreparedHandover, error) {
	tracef("prepare %s start", successor.ID)
	p, err := s.hp.PrepareHandover(ctx, name, token, term, successor, wait)
	tracef("prepare end err=%v", err)
	if err != nil {
		return nil, err
	}
	return &tracedHandover{p, successor.ID}, nil
}

// tracedHandover traces the Commit of a prepared handover as ReleaseTo's.
type tracedHandover struct {
	leader.PreparedHandover
	to string
}

// Stage passes on to the prepared handover's Stage, if it has one (see
// leader.HandoverStager), tracing it.
func (h *tracedHandover) Stage(ctx context.Context, reason leader.GrantReason, hold time.Duration) error {
	hs, ok := h.PreparedHandover.(leader.HandoverStager)
	if !ok {
		return nil
	}
	tracef("stage %s start", h.to)
	err := hs.Stage(ctx, reason, hold)
	tracef("stage end err=%v", err)
	return err
}

func (h *tracedHandover) Commit(ctx context.Context, reason leader.GrantReason, hold time.Duration) error {
	tracef("release-to %s start", h.to)
	err := h.PreparedHandover.Commit(ctx, reason, hold)
	tracef("release-to end err=%v", err)
	return err
}

// --- the skill's table and heartbeat ---

func skillBackend(spec childSpec, logger *slog.Logger) (*backend, error) {
	pool, counter, err := tracedPool(spec.ConnString)
	if err != nil {
		return nil, err
	}
	return &backend{
		newCandidate: func(id string, h hooks) (candidate, error) {
			l := skill.New(pool, skill.Config{
				ServiceName:             spec.Name,
				CandidateID:             id,
				HeartbeatInterval:       spec.Timing.Renew.D(),
				HeartbeatTimeoutSeconds: int(spec.Timing.TTL.D() / time.Second),
				OnBecomeLeader:          func() { h.elected(0, "") },
				OnLoseLeadership:        h.demoted,
				Logger:                  slog.New(slog.DiscardHandler),
			})
			return &skillCandidate{l: l, ready: h.ready}, nil
		},
		counts: counter.snapshot,
		warmUp: pingPool(pool),
		close:  pool.Close,
	}, nil
}

type skillCandidate struct {
	l     *skill.LeaderElection
	ready func()
	done  chan struct{}
}

func (c *skillCandidate) start() {
	c.done = make(chan struct{})
	go func() {
		defer close(c.done)
		c.l.Start(context.Background()) // returns after the first attempt
		c.ready()
	}()
}

func (c *skillCandidate) stop() {
	<-c.done
	c.l.Stop(context.Background())
}

// --- client-go's LeaderElector on a PostgreSQL resourcelock ---

func clientGoBackend(spec childSpec) (*backend, error) {
	pool, counter, err := tracedPool(spec.ConnString)
	if err != nil {
		return nil, err
	}
	return &backend{
		newCandidate: func(id string, h hooks) (candidate, error) {
			lock := pglock.New(pool, spec.Name, id)
			var once sync.Once
			lock.AfterCall = func() { once.Do(h.ready) }
			var (
				mu  sync.Mutex
				led bool
			)
			le, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
				Lock:            lock,
				Name:            spec.Name,
				LeaseDuration:   spec.Timing.TTL.D(),
				RenewDeadline:   spec.Timing.RenewDeadline.D(),
				RetryPeriod:     spec.Timing.Renew.D(),
				ReleaseOnCancel: true,
				Callbacks: leaderelection.LeaderCallbacks{
					OnStartedLeading: func(context.Context) {
						mu.Lock()
						led = true
						mu.Unlock()
						h.elected(0, "")
					},
					OnStoppedLeading: func() {
						mu.Lock()
						wasLeader := led
						led = false
						mu.Unlock()
						if wasLeader {
							h.demoted()
						}
					},
				},
			})
			if err != nil {
				return nil, err
			}
			return &goCandidate{run: le.Run}, nil
		},
		counts: counter.snapshot,
		warmUp: pingPool(pool),
		close:  pool.Close,
	}, nil
}

// --- etcd's concurrency.Election ---

// countedEtcdClient returns a client of spec's etcd server whose gRPC
// requests counter counts.
func countedEtcdClient(spec childSpec) (*clientv3.Client, *grpcCounter, error) {
	counter := &grpcCounter{}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   []string{spec.Etcd},
		DialTimeout: 5 * time.Second,
		DialOptions: counter.dialOptions(),
		Logger:      zap.NewNop(),
	})
	return cli, counter, err
}

// etcdPrefix is the key prefix of an election on etcd.
func etcdPrefix(name string) string { return "/leaderbench/" + name }

func etcdBackend(spec childSpec) (*backend, error) {
	cli, counter, err := countedEtcdClient(spec)
	if err != nil {
		return nil, err
	}
	ttl := int(spec.Timing.TTL.D() / time.Second)
	return &backend{
		newCandidate: func(id string, h hooks) (candidate, error) {
			return &etcdCandidate{cli: cli, ttl: ttl, prefix: etcdPrefix(spec.Name), id: id, h: h}, nil
		},
		counts: counter.snapshot,
		warmUp: func() error {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_, err := cli.Get(ctx, "/leaderbench/warm-up")
			return err
		},
		close: func() { cli.Close() },
	}, nil
}

// etcdCandidate campaigns with a session of its own (a lease kept alive
// every TTL/3 by the client); stop resigns if leading, then closes the
// session (revoking the lease).
type etcdCandidate struct {
	cli    *clientv3.Client
	ttl    int
	prefix string
	id     string
	h      hooks

	cancel context.CancelFunc
	done   chan struct{}
	mu     sync.Mutex
	sess   *concurrency.Session
	el     *concurrency.Election
	led    bool
}

func (c *etcdCandidate) start() {
	ctx, cancel := context.WithCancel(context.Background())
	c.cancel, c.done = cancel, make(chan struct{})
	go func() {
		defer close(c.done)
		sess, err := concurrency.NewSession(c.cli, concurrency.WithTTL(c.ttl))
		if err != nil {
			slog.Error("etcd session", slog.Any("error", err))
			return
		}
		el := concurrency.NewElection(sess, c.prefix)
		c.mu.Lock()
		c.sess, c.el = sess, el
		c.mu.Unlock()
		// Ready once the campaign's key exists (Campaign puts it first,
		// then waits for the keys before it to go).
		go func() {
			key := fmt.Sprintf("%s/%x", c.prefix, sess.Lease())
			for ctx.Err() == nil {
				resp, err := c.cli.Get(ctx, key, clientv3.WithCountOnly())
				if err == nil && resp.Count > 0 {
					c.h.ready()
					return
				}
				time.Sleep(5 * time.Millisecond) // poll interval
			}
		}()
		if err := el.Campaign(ctx, c.id); err != nil {
			return // stopped, or the session ended
		}
		c.mu.Lock()
		c.led = true
		c.mu.Unlock()
		c.h.elected(uint64(el.Rev()), "")
		select {
		case <-sess.Done():
			if ctx.Err() == nil {
				c.mu.Lock()
				c.led = false
				c.mu.Unlock()
				c.h.demoted()
			}
		case <-ctx.Done():
		}
	}()
}

func (c *etcdCandidate) stop() {
	c.cancel()
	<-c.done
	c.mu.Lock()
	sess, el, led := c.sess, c.el, c.led
	c.led = false
	c.mu.Unlock()
	if sess == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if led {
		if err := el.Resign(ctx); err != nil && !errors.Is(err, context.Canceled) {
			slog.Error("etcd resign", slog.Any("error", err))
		}
	}
	sess.Close()
}
