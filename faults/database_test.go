package faults_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/internal/history"
	"github.com/leaderelect/leader/internal/pgtest"
	"github.com/leaderelect/leader/postgres"
)

// Bounds and pacing of the database faults.
const (
	// poolConns is the size of each candidate's pool, which its store
	// shares with the application's work: small, so that the work can
	// take all of it.
	poolConns = 4
	// readOnlyFor is how long the database stays read-only, from the
	// failover to the promotion: longer than the TTL, so that the lease of
	// the leader before the failover runs out meanwhile.
	readOnlyFor = 3 * ttl / 2
	// exhaustFor is how long the application's work holds every
	// connection of the leader's pool: longer than the TTL.
	exhaustFor = 3 * ttl / 2
	// longRestart is how long the server stays down in every other
	// restart: longer than the TTL, so that every lease runs out meanwhile
	// and every leader's local deadline passes. The other restarts start
	// the server again at once.
	longRestart = 5 * ttl / 4
	// maxDatabaseTakeover bounds a takeover, from the end of the old
	// leader's belief to the new leader's OnElected, beyond the outage (the
	// time the server refused every grant: down, or read-only): the rest
	// of the old lease (at most the TTL), a follower's next attempt (at
	// most RetryInterval, TTL/3, plus jitter), the advisory strategy's
	// TakeoverGrace, and slack for a loaded machine. Generous: the point is
	// to catch a takeover that does not happen, not to benchmark.
	maxDatabaseTakeover = 3 * ttl
	// awaitLeaderWithin bounds the wait for the leader to fault at the
	// start of a trial: a scenario's first election, or the leader the
	// previous trial ended with.
	awaitLeaderWithin = 15 * time.Second
)

// databaseFault is a fault of the database server, or of the current
// leader's connection pool.
type databaseFault struct {
	name string
	// inject applies the fault, in the scenario's trial, with cur
	// leading, and returns once it is over, with the outage: how long the
	// server refused every grant (0 if it never did).
	inject func(t *testing.T, s *databaseScenario, trial int, cur *databaseCandidate) (outage time.Duration)
	// mayKeep lists the strategies on which the leader may lead on
	// through the fault if the outage was shorter than the TTL: there a
	// takeover may happen, and is counted if it does. Elsewhere it must.
	mayKeep []string
	// mustKeep lists the strategies on which the leader must lead on
	// through the fault: a takeover there fails the trial.
	mustKeep []string
	// lossReason is, per strategy, why the leader must say it lost its
	// leadership to the fault (leader.Metrics.Lost); none for any reason.
	lossReason map[string]leader.LossReason
}

var databaseFaults = []databaseFault{
	{
		// Every session of the leader ended by the server, as an
		// administrator or a connection killer would. The lease store's
		// pool opens new connections, and the lease outlives them.
		name:    "terminate",
		inject:  terminateLeader,
		mayKeep: []string{"lease"},
	},
	{
		// pg_ctl stop -m fast, then start, at once or after longRestart
		// (see restart). The lease outlives a short restart; the
		// advisory lock ends with its session.
		name:    "restart-fast",
		inject:  restart((*pgtest.Cluster).Stop),
		mayKeep: []string{"lease"},
	},
	{
		// As restart-fast, but every server process quits at once,
		// without a checkpoint, and the start runs crash recovery. With
		// synchronous_commit off (as on the test cluster) the commits
		// whose WAL was still in the server's buffers are lost, unless
		// they were made durable: the stores' grants and renewals are.
		name:    "restart-immediate",
		inject:  restart((*pgtest.Cluster).StopImmediate),
		mayKeep: []string{"lease"},
	},
	{
		// SIGKILL to the postmaster, as the OOM killer would: its
		// backends end when they notice, then the start runs crash
		// recovery, as after an immediate shutdown.
		name:    "postmaster-kill",
		inject:  restart((*pgtest.Cluster).Kill),
		mayKeep: []string{"lease"},
	},
	{
		// The server turned read-only, then a failover to a read-only
		// replica; see readOnly. A lease leader steps down at its first
		// refused renewal, without waiting for its deadline. An advisory
		// leader steps down at its first refused heartbeat or when its
		// session ends, whichever comes first.
		name:       "read-only",
		inject:     readOnly,
		lossReason: map[string]leader.LossReason{"lease": leader.LossError},
	},
	{
		// The application's own work holds every connection of the
		// leader's pool for longer than the TTL. The stores send their
		// statements on connections of their own (Options.MaxConns), so
		// the leader leads on, on both strategies.
		name:     "pool-exhausted",
		inject:   exhaustPool,
		mayKeep:  []string{"lease", "advisory"},
		mustKeep: []string{"lease", "advisory"},
	},
}

// Every database fault on every strategy, each scenario on a private
// cluster, a few times each in CI mode, for as long as LEADER_SOAK says in
// soak mode. See the package documentation.
func TestDatabaseFaults(t *testing.T) {
	t.Parallel()
	rounds(t, ciTrials, soakTrials, func(t *testing.T, trials int) {
		for _, f := range databaseFaults {
			for _, strategy := range strategies {
				t.Run(fmt.Sprintf("the %s store keeps one leader through a %s of the database", strategy, f.name), func(t *testing.T) {
					t.Parallel()
					record(t, f.name, strategy, runDatabaseScenario(t, f, strategy, trials))
				})
			}
		}
	})
}

// databaseCandidate is one Elector of a database scenario.
type databaseCandidate struct {
	id      string
	appName string        // its connections' application_name
	pool    *pgxpool.Pool // its store's, shared with the application's work
	e       *leader.Elector
	rec     *history.Recorder
	losses  *lossLog
	stop    func()
}

// databaseScenario is one database fault on one strategy, over several
// trials, on a private cluster.
type databaseScenario struct {
	fault      databaseFault
	strategy   string
	cluster    *pgtest.Cluster
	connString string // the candidates' database on cluster
	database   string
	cands      []*databaseCandidate
	fence      *fence // on the shared cluster, which no fault touches
}

// runDatabaseScenario runs trials of fault f on the strategy's store and
// checks the histories.
func runDatabaseScenario(t *testing.T, f databaseFault, strategy string, trials int) result {
	s := &databaseScenario{fault: f, strategy: strategy, cluster: pgtest.NewCluster(t)}
	s.connString = s.cluster.NewDatabase(t)
	cfg, err := pgx.ParseConfig(s.connString)
	if err != nil {
		t.Fatal(err)
	}
	s.database = cfg.Database
	migrate(t, s.connString)
	// The register is not on the faulty server: a restart must not lose
	// its writes, nor a read-only server refuse them, since it stands for
	// a resource elsewhere that the leader's work writes to.
	s.fence = setupFence(t, pgtest.OpenPool(t, pgtest.NewDatabase(t)))
	dir := t.TempDir()
	for i := range candidates {
		s.cands = append(s.cands, s.newCandidate(t, dir, fmt.Sprint("e", i)))
	}

	var (
		takenTerms []uint64 // the faulted terms that another term followed
		maxOutage  time.Duration
	)
	var term uint64 = 1
	for trial := range trials {
		// The faulted leader led on, or its successor leads now.
		var cur *databaseCandidate
		cur, term = s.awaitLeader(t, term, awaitLeaderWithin)
		// The fault's timing relative to the renewals, at random.
		time.Sleep(rand.N(maxInjectDelay + 1))
		injected := time.Now()
		outage := f.inject(t, s, trial, cur)
		healed := time.Now()
		maxOutage = max(maxOutage, outage)

		// A leader cannot lead on through an outage of a TTL or more:
		// its last renewal was sent before the outage began, and its
		// local deadline is less than a TTL after that.
		mayKeep := slices.Contains(f.mayKeep, strategy) && outage < ttl
		next, nextTerm, tookOver := s.awaitOutcome(t, trial, cur, term, injected, healed, mayKeep)
		if !tookOver {
			t.Logf("trial %d: %s led on with term %d through the %s (outage %v)", trial, cur.id, term, f.name, outage.Round(time.Millisecond))
			continue
		}
		if slices.Contains(f.mustKeep, strategy) {
			t.Errorf("trial %d: %s lost term %d to the %s, which a leader must lead through; %s was elected with term %d",
				trial, cur.id, term, f.name, next.id, nextTerm)
		}
		takenTerms = append(takenTerms, term)
		if st := cur.e.Status(); st.IsLeader && st.Term == term {
			t.Errorf("trial %d: %s still believes it leads with term %d after %s was elected with term %d", trial, cur.id, term, next.id, nextTerm)
		}
		s.fence.lateWrite(t, trial, cur.id, term, nextTerm)
		reason, at, ok := cur.losses.firstAfter(injected)
		switch want := f.lossReason[strategy]; {
		case !ok:
			t.Errorf("trial %d: %s lost term %d but reported no loss", trial, cur.id, term)
		case want != "" && reason != want:
			t.Errorf("trial %d: %s lost term %d for reason %q, want %q", trial, cur.id, term, reason, want)
		default:
			t.Logf("trial %d: %s stepped down from term %d %v after the %s began (%s; outage %v); %s elected with term %d",
				trial, cur.id, term, at.Sub(injected).Round(time.Millisecond), f.name, reason, outage.Round(time.Millisecond), next.id, nextTerm)
		}
		term = nextTerm
	}

	s.stop(t)
	r, _ := s.check(t, dir, trials, takenTerms, maxDatabaseTakeover+maxOutage)
	return r
}

// migrate creates the stores' tables in connString's database.
func migrate(t *testing.T, connString string) {
	t.Helper()
	migrating, err := pgxpool.New(context.Background(), connString)
	if err != nil {
		t.Fatal(err)
	}
	err = postgres.Migrate(callCtx(t), migrating, postgres.Options{})
	migrating.Close()
	if err != nil {
		t.Fatalf("Migrate: %v", err)
	}
}

// stop stops every candidate's Elector, at once, and closes its history
// recorder.
func (s *databaseScenario) stop(t *testing.T) {
	t.Helper()
	var wg sync.WaitGroup
	for _, c := range s.cands {
		wg.Go(c.stop)
	}
	wg.Wait()
	for _, c := range s.cands {
		if err := c.rec.Close(); err != nil {
			t.Fatalf("%s: %v", c.id, err)
		}
	}
}

// check checks the histories of beliefs and of the register, and returns the
// scenario's result and the report on the beliefs. Takeovers are counted
// only from the faulted leaders that were followed by another term: a
// leader that led on through its fault was not taken over, and the
// handovers when the scenario stops its Electors are not the fault's.
func (s *databaseScenario) check(t *testing.T, dir string, trials int, takenTerms []uint64, maxTakeover time.Duration) (result, history.Report) {
	evs, err := history.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	rep := checkBeliefs(t, evs, history.Bounds{MaxTakeover: maxTakeover})
	r := result{trials: trials, overlaps: len(rep.Overlaps), termRegressions: len(rep.TermRegressions)}
	for _, tk := range rep.Takeovers {
		if slices.Contains(takenTerms, tk.From.Term) {
			r.takeovers = append(r.takeovers, tk.Gap)
		}
	}
	if len(r.takeovers) != len(takenTerms) {
		t.Errorf("%d takeovers from the %d faulted leaders followed by another term (terms %v):\n%v", len(r.takeovers), len(takenTerms), takenTerms, rep)
	}

	accepted, refused, stale := s.fence.check(t)
	r.staleRefused, r.staleAccepted = refused, stale
	t.Logf("%d of %d trials ended in a takeover: %v (bound %v); fenced register: %d writes accepted, %d refused",
		len(r.takeovers), trials, history.Summarize(r.takeovers), maxTakeover, accepted, refused)
	return r, rep
}

// newCandidate starts an Elector for id with a pool and a store of its own.
func (s *databaseScenario) newCandidate(t *testing.T, dir, id string) *databaseCandidate {
	t.Helper()
	c := &databaseCandidate{id: id, appName: "faults-" + id, losses: &lossLog{}}
	cfg, err := pgxpool.ParseConfig(s.connString)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = poolConns
	// Every connection of the candidate's, from the pool or opened from
	// its configuration (the stores' listeners, the advisory sessions and
	// lock waiters), says whose it is in pg_stat_activity.
	cfg.ConnConfig.RuntimeParams["application_name"] = c.appName
	if c.pool, err = pgxpool.NewWithConfig(context.Background(), cfg); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.pool.Close)
	store := newStore(t, s.strategy, c.pool)
	c.e, c.rec, c.stop = s.fence.startElector(t, dir, id, store, ttl, c.losses)
	return c
}

// awaitLeader waits for a leader with a term of at least atLeast that has
// had a few writes accepted, and for every candidate to have had a store
// call answered. The faults strike a group that runs: an Elector that has
// had no answer yet ends its Run once the store has refused it as
// read-only for a TTL (a standby at start, see leader.ErrPermanent), and
// on a loaded machine a follower's first attempts may still be timing out
// (opening its session) when the first trial's fault begins.
func (s *databaseScenario) awaitLeader(t *testing.T, atLeast uint64, within time.Duration) (*databaseCandidate, uint64) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		var (
			cur        *databaseCandidate
			term       uint64
			unanswered []string
		)
		for _, c := range s.cands {
			st := c.e.Status()
			if st.LastContact.IsZero() {
				unanswered = append(unanswered, c.id)
			}
			if st.IsLeader && st.Term >= atLeast && s.fence.written(st.Term) >= 3 {
				cur, term = c, st.Term
			}
		}
		switch {
		case cur != nil && len(unanswered) == 0:
			return cur, term
		case time.Now().After(deadline):
			t.Fatalf("no leader with a term of at least %d that has written within %v, or not every candidate answered (a leader: %v; no store call answered yet: %v)",
				atLeast, within, cur != nil, unanswered)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// awaitOutcome waits, once the fault injected into cur leading with term
// is over (at healed), for a leader with a greater term that has written,
// and returns it. If mayKeep, it reports instead that cur led on (tookOver
// false) if cur still leads with term a TTL after healed and has reported
// no loss since injected: it then renewed after the fault (its local
// deadline is less than a TTL after its last renewal was sent). Without
// mayKeep that fails the test. A leader with a term not above term, after
// cur lost it, is a term regression: it fails the test and is returned as
// the next leader, so that the rest of the checks see it too.
func (s *databaseScenario) awaitOutcome(t *testing.T, trial int, cur *databaseCandidate, term uint64, injected, healed time.Time, mayKeep bool) (next *databaseCandidate, nextTerm uint64, tookOver bool) {
	t.Helper()
	deadline := healed.Add(maxDatabaseTakeover + 2*ttl)
	for {
		_, _, curLost := cur.losses.firstAfter(injected)
		for _, c := range s.cands {
			st := c.e.Status()
			switch {
			case !st.IsLeader:
			case st.Term > term && s.fence.written(st.Term) >= 3:
				return c, st.Term, true
			case st.Term <= term && (c != cur || curLost):
				t.Errorf("trial %d: term regression: %s leads with term %d after %s lost term %d to the %s",
					trial, c.id, st.Term, cur.id, term, s.fault.name)
				return c, st.Term, true
			}
		}
		if st := cur.e.Status(); time.Since(healed) >= ttl && st.IsLeader && st.Term == term && !curLost {
			if mayKeep {
				return cur, term, false
			}
			t.Fatalf("trial %d: %s still leads with term %d a TTL after the %s, which must end its leadership on the %s store, in %v",
				trial, cur.id, term, s.fault.name, s.strategy, healed.Sub(injected).Round(time.Millisecond))
		}
		if time.Now().After(deadline) {
			t.Fatalf("trial %d: no leader with a term above %d that has written, %v after the %s ended", trial, term, time.Since(healed), s.fault.name)
		}
		time.Sleep(5 * time.Millisecond) // poll interval
	}
}

// terminate ends with pg_terminate_backend every session that where (a
// condition on pg_stat_activity, with args) selects, and waits until each
// has exited. It returns how many it ended.
func (s *databaseScenario) terminate(t *testing.T, where string, args ...any) int {
	t.Helper()
	var n int
	err := s.cluster.Admin(t).QueryRow(callCtx(t), `
		SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 10000))
		FROM pg_stat_activity
		WHERE pid <> pg_backend_pid() AND `+where, args...).Scan(&n)
	if err != nil {
		t.Fatalf("terminating sessions: %v", err)
	}
	return n
}

// terminateLeader ends every session of the leader's: its pool's
// connections, its store's listener, and the advisory store's session and
// lock waiter.
func terminateLeader(t *testing.T, s *databaseScenario, _ int, cur *databaseCandidate) time.Duration {
	if n := s.terminate(t, "datname = $1 AND application_name = $2", s.database, cur.appName); n == 0 {
		t.Fatalf("%s has no session to terminate", cur.id)
	}
	return 0
}

// restart returns the fault that stops the server with stop and starts it
// again, at once in even trials and longRestart after the stop in odd ones;
// the outage is from the stop to the end of the start.
func restart(stop func(*pgtest.Cluster, testing.TB)) func(*testing.T, *databaseScenario, int, *databaseCandidate) time.Duration {
	return func(t *testing.T, s *databaseScenario, trial int, _ *databaseCandidate) time.Duration {
		start := time.Now()
		stop(s.cluster, t)
		if trial%2 == 1 {
			time.Sleep(time.Until(start.Add(longRestart))) // the server is down
		}
		s.cluster.Start(t)
		return time.Since(start)
	}
}

// readOnly turns the server read-only under the running sessions, then
// fails the database over to a read-only replica, and promotes it
// readOnlyFor later. The server is the same, but a client sees what it
// sees when a server is switched to read-only (as some managed services do
// when the disk fills up) and then in a failover to a hot standby:
// default_transaction_read_only is turned on for the whole server, so that
// every write, on a live session or a new one, is refused with SQLSTATE
// 25006 as a hot standby refuses it; then every session of the database
// ends (the old primary is gone), and with them every advisory lock; reads
// work. The promotion (pg_promote) then makes the sessions writable without
// ending them, as turning default_transaction_read_only off and reloading
// does. Not modelled: a replica that lags behind the primary, which loses
// the last commits as a crash does (see restart-immediate).
func readOnly(t *testing.T, s *databaseScenario, _ int, _ *databaseCandidate) time.Duration {
	start := time.Now()
	s.cluster.Exec(t, "ALTER SYSTEM SET default_transaction_read_only = on")
	s.cluster.Exec(t, "SELECT pg_reload_conf()")
	// The reload is asynchronous: wait until a new session is read-only,
	// so that no session of the database can still write once the old
	// ones are ended.
	electortest.Eventually(t, 10*time.Second, "the server to be read-only", func() bool {
		conn, err := pgx.Connect(callCtx(t), s.connString)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(context.Background())
		var ro string
		if err := conn.QueryRow(callCtx(t), "SHOW default_transaction_read_only").Scan(&ro); err != nil {
			t.Fatal(err)
		}
		return ro == "on"
	})
	s.terminate(t, "datname = $1", s.database)
	time.Sleep(time.Until(start.Add(readOnlyFor))) // the replica serves, read-only
	s.cluster.Exec(t, "ALTER SYSTEM RESET default_transaction_read_only")
	s.cluster.Exec(t, "SELECT pg_reload_conf()")
	return time.Since(start)
}

// exhaustPool makes the application's work take every connection of the
// leader's pool, and hold each in a query for exhaustFor.
func exhaustPool(t *testing.T, _ *databaseScenario, _ int, cur *databaseCandidate) time.Duration {
	conns := make([]*pgxpool.Conn, poolConns)
	for i := range conns {
		// A renewal in flight holds one connection for a moment.
		var err error
		if conns[i], err = cur.pool.Acquire(callCtx(t)); err != nil {
			t.Fatalf("%s: taking connection %d of its pool: %v", cur.id, i, err)
		}
	}
	ctx := callCtx(t)
	var wg sync.WaitGroup
	errs := make([]error, len(conns))
	for i, conn := range conns {
		wg.Go(func() {
			defer conn.Release()
			_, errs[i] = conn.Exec(ctx, "SELECT pg_sleep($1)", exhaustFor.Seconds())
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("%s: the application's work on connection %d: %v", cur.id, i, err)
		}
	}
	return 0
}

// lossLog is a leader.Metrics that records when and why leadership was
// lost.
type lossLog struct {
	leader.NopMetrics
	mu     sync.Mutex
	losses []loss
}

type loss struct {
	at     time.Time
	reason leader.LossReason
}

// Lost implements leader.Metrics.
func (l *lossLog) Lost(_ string, reason leader.LossReason) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.losses = append(l.losses, loss{at: time.Now(), reason: reason})
}

// firstAfter returns the first loss recorded after from.
func (l *lossLog) firstAfter(from time.Time) (leader.LossReason, time.Time, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, ls := range l.losses {
		if ls.at.After(from) {
			return ls.reason, ls.at, true
		}
	}
	return "", time.Time{}, false
}
