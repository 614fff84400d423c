package postgres

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/internal/pgtest"
)

// fenceFixture is an election of one strategy on a fresh database with a
// table for the leader's writes (fencedWrites).
type fenceFixture struct {
	pool  *pgxpool.Pool
	store leader.Store
	// grant grants name to c for ttl, and leaves the lease as the
	// strategy's Electors keep it (under a heartbeat, for "lease under a
	// heartbeat").
	grant func(t *testing.T, name string, c leader.Candidate, ttl time.Duration) leader.Lease
	// end ends the lease of name without a release, and returns once it
	// is no longer held: it runs out (lease), or the server ends its
	// holder's session (advisory).
	end func(t *testing.T, name string)
	// shortTTL is a TTL to grant with for end: as short as the strategy
	// allows while leaving a fence time to run first.
	shortTTL time.Duration
}

// fencedWrites is the table of the leader's writes in these tests.
const fencedWrites = `CREATE TABLE fenced_writes (note text PRIMARY KEY, term bigint NOT NULL)`

// fenceStrategies returns the fixtures of the lease strategy (a lease on
// its own expiry, and one under a heartbeat) and of the advisory strategy.
func fenceStrategies() []struct {
	name  string
	setup func(t *testing.T) fenceFixture
} {
	leaseFixture := func(t *testing.T, underBeat bool) fenceFixture {
		b := setup(t)
		mustExec(t, b.pool, fencedWrites)
		return fenceFixture{
			pool: b.pool, store: b.store, shortTTL: 2 * time.Second,
			grant: func(t *testing.T, name string, c leader.Candidate, ttl time.Duration) leader.Lease {
				t.Helper()
				l := mustGrant(t, b.store, name, c, ttl)
				if underBeat {
					mustRenewBatch(t, b.store, renewals(c, ttl, l))
					heartbeatOf(t, b.pool, name)
				}
				return l
			},
			end: func(t *testing.T, name string) {
				t.Helper()
				electortest.Eventually(t, time.Minute, "the lease to run out", func() bool { return !observe(t, b.store, name).Held() })
			},
		}
	}
	return []struct {
		name  string
		setup func(t *testing.T) fenceFixture
	}{
		{"lease", func(t *testing.T) fenceFixture { return leaseFixture(t, false) }},
		{"lease under a heartbeat", func(t *testing.T) fenceFixture { return leaseFixture(t, true) }},
		{"advisory", func(t *testing.T) fenceFixture {
			pool := pgtest.NewPool(t)
			s := setupAdvisory(t, pool, Options{})
			mustExec(t, pool, fencedWrites)
			return fenceFixture{
				pool: pool, store: s, shortTTL: time.Minute,
				grant: func(t *testing.T, name string, c leader.Candidate, ttl time.Duration) leader.Lease {
					t.Helper()
					return mustGrant(t, s, name, c, ttl)
				},
				end: func(t *testing.T, name string) {
					t.Helper()
					mustExec(t, pool, `SELECT pg_terminate_backend(holder_pid) FROM leader_advisory WHERE name = $1`, name)
					electortest.Eventually(t, time.Minute, "the holder's session to end", func() bool { return !observe(t, s, name).Held() })
				},
			}
		}},
	}
}

func mustExec(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) {
	t.Helper()
	if _, err := pool.Exec(callCtx(t), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// fencedWrite writes note in a transaction fenced with name and term, as a
// leader's work does, and returns Fence's error or the commit's.
func fencedWrite(t *testing.T, pool *pgxpool.Pool, opts Options, name string, term uint64, note string) error {
	t.Helper()
	return pgx.BeginFunc(callCtx(t), pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(callCtx(t), `INSERT INTO fenced_writes VALUES ($1, $2)`, note, int64(term)); err != nil {
			return err
		}
		return Fence(callCtx(t), tx, opts, name, term)
	})
}

// written reports whether note was written.
func written(t *testing.T, pool *pgxpool.Pool, note string) bool {
	t.Helper()
	var found bool
	if err := pool.QueryRow(callCtx(t), `SELECT EXISTS (SELECT FROM fenced_writes WHERE note = $1)`, note).Scan(&found); err != nil {
		t.Fatal(err)
	}
	return found
}

// wantFenced checks that err refuses term, and that note was not written.
func wantFenced(t *testing.T, err error, pool *pgxpool.Pool, term uint64, note string) {
	t.Helper()
	var pgErr *pgconn.PgError
	switch {
	case !errors.Is(err, leader.ErrLeaseLost):
		t.Fatalf("fenced write of term %d: %v; want an error wrapping leader.ErrLeaseLost", term, err)
	case !errors.As(err, &pgErr) || pgErr.Code != FenceSQLState:
		t.Errorf("fenced write of term %d: %v; want the server's error with SQLSTATE %s", term, err, FenceSQLState)
	case !strings.Contains(err.Error(), fmt.Sprintf("term %d does not hold the lease", term)):
		t.Errorf("fenced write of term %d: %q does not say which term was refused", term, err)
	}
	if written(t, pool, note) {
		t.Errorf("the write %q of refused term %d is visible", note, term)
	}
}

func TestFence(t *testing.T) {
	t.Parallel()
	for _, strategy := range fenceStrategies() {
		t.Run(strategy.name, func(t *testing.T) {
			t.Parallel()

			t.Run("the holder's fenced transaction commits", func(t *testing.T) {
				t.Parallel()
				f := strategy.setup(t)
				alice := candidate("alice")
				l := f.grant(t, "report", alice, time.Minute)
				if err := fencedWrite(t, f.pool, Options{}, "report", l.Term, "alice"); err != nil {
					t.Fatalf("fenced write of the holder's term %d: %v", l.Term, err)
				}
				if !written(t, f.pool, "alice") {
					t.Fatal("the holder's fenced write is not visible")
				}
			})

			t.Run("a term that does not hold the lease is refused: never granted, another, the next", func(t *testing.T) {
				t.Parallel()
				f := strategy.setup(t)
				wantFenced(t, fencedWrite(t, f.pool, Options{}, "never", 1, "never"), f.pool, 1, "never")
				l := f.grant(t, "report", candidate("alice"), time.Minute)
				for _, term := range []uint64{0, l.Term + 1, math.MaxInt64, math.MaxUint64} {
					note := fmt.Sprint("term ", term)
					err := fencedWrite(t, f.pool, Options{}, "report", term, note)
					if term > math.MaxInt64 {
						// Sent as 0, which no grant has; the error names
						// the term asked for.
						if !errors.Is(err, leader.ErrLeaseLost) || !strings.Contains(err.Error(), fmt.Sprint(term)) || written(t, f.pool, note) {
							t.Errorf("fenced write of term %d: %v; want it refused, naming the term", term, err)
						}
						continue
					}
					wantFenced(t, err, f.pool, term, note)
				}
			})

			t.Run("a released term is refused and its write is not visible", func(t *testing.T) {
				t.Parallel()
				f := strategy.setup(t)
				alice := candidate("alice")
				l := f.grant(t, "report", alice, time.Minute)
				mustRelease(t, f.store, "report", alice, l.Term)
				wantFenced(t, fencedWrite(t, f.pool, Options{}, "report", l.Term, "after release"), f.pool, l.Term, "after release")
			})

			t.Run("a term whose lease ended without a release is refused before anyone is granted", func(t *testing.T) {
				t.Parallel()
				f := strategy.setup(t)
				l := f.grant(t, "report", candidate("alice"), f.shortTTL)
				f.end(t, "report")
				wantFenced(t, fencedWrite(t, f.pool, Options{}, "report", l.Term, "ended"), f.pool, l.Term, "ended")
			})

			t.Run("a term taken over is refused, and the new holder's commits", func(t *testing.T) {
				t.Parallel()
				f := strategy.setup(t)
				l := f.grant(t, "report", candidate("alice"), f.shortTTL)
				f.end(t, "report")
				next := f.grant(t, "report", candidate("bob"), time.Minute)
				if next.Term != l.Term+1 {
					t.Fatalf("takeover granted term %d after %d", next.Term, l.Term)
				}
				wantFenced(t, fencedWrite(t, f.pool, Options{}, "report", l.Term, "alice, late"), f.pool, l.Term, "alice, late")
				if err := fencedWrite(t, f.pool, Options{}, "report", next.Term, "bob"); err != nil {
					t.Fatalf("fenced write of the new holder's term %d: %v", next.Term, err)
				}
			})

			t.Run("a takeover waits for a fenced transaction open before it began", func(t *testing.T) {
				t.Parallel()
				f := strategy.setup(t)
				l := f.grant(t, "report", candidate("alice"), f.shortTTL)
				tx, err := f.pool.Begin(callCtx(t))
				if err != nil {
					t.Fatal(err)
				}
				defer tx.Rollback(context.Background())
				if err := Fence(callCtx(t), tx, Options{}, "report", l.Term); err != nil {
					t.Fatalf("Fence of the holder's term %d: %v", l.Term, err)
				}
				if _, err := tx.Exec(callCtx(t), `INSERT INTO fenced_writes VALUES ('alice, slow', $1)`, int64(l.Term)); err != nil {
					t.Fatal(err)
				}
				// The holder stalls past its lease; another candidate
				// comes for it.
				f.end(t, "report")
				type grant struct {
					l       leader.Lease
					granted bool
					err     error
				}
				took := make(chan grant, 1)
				go func() {
					l, granted, err := f.store.Acquire(callCtx(t), "report", candidate("bob"), time.Minute)
					took <- grant{l, granted, err}
				}()
				waitBlockedBy(t, f.pool, tx, "the takeover", func() {
					if len(took) > 0 {
						t.Fatalf("the takeover returned while the fenced transaction was open: %+v", <-took)
					}
				})
				if err := tx.Commit(callCtx(t)); err != nil {
					t.Fatalf("commit of the fenced transaction (the lease ran out after Fence, and nobody was granted it meanwhile): %v", err)
				}
				g := <-took
				if g.err != nil || !g.granted || g.l.Term != l.Term+1 {
					t.Fatalf("takeover after the commit: %+v, granted %v, %v; want term %d", g.l, g.granted, g.err, l.Term+1)
				}
				if !written(t, f.pool, "alice, slow") {
					t.Error("the fenced write committed before the takeover is not visible")
				}
				wantFenced(t, fencedWrite(t, f.pool, Options{}, "report", l.Term, "alice, later"), f.pool, l.Term, "alice, later")
			})
		})
	}
}

// waitBlockedBy waits until a backend of the database waits for a lock
// that tx holds, and calls check before each look and after the last one,
// to fail the test at once if what should wait did not.
func waitBlockedBy(t *testing.T, pool *pgxpool.Pool, tx pgx.Tx, what string, check func()) {
	t.Helper()
	pid := tx.Conn().PgConn().PID()
	electortest.Eventually(t, time.Minute, what+" to wait for the fenced transaction", func() bool {
		check()
		var waiting bool
		err := pool.QueryRow(callCtx(t), `SELECT EXISTS (SELECT FROM pg_stat_activity
			WHERE datname = current_database() AND $1::int = ANY (pg_blocking_pids(pid)))`, int(pid)).Scan(&waiting)
		if err != nil {
			t.Fatal(err)
		}
		return waiting
	})
	check()
}

// TestFenceHoldsOffAMoveToTheOtherStrategy checks that a name cannot move
// to the other strategy, and be granted there, while a fenced transaction
// of its lease is open: the claim waits for the transaction.
func TestFenceHoldsOffAMoveToTheOtherStrategy(t *testing.T) {
	t.Parallel()
	b := setup(t)
	advisory := setupAdvisory(t, b.pool, Options{})
	mustExec(t, b.pool, fencedWrites)
	const advisoryTTL = time.Second
	l := mustGrant(t, b.store, "report", candidate("alice"), 2*time.Second)
	tx, err := b.pool.Begin(callCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	if err := Fence(callCtx(t), tx, Options{}, "report", l.Term); err != nil {
		t.Fatalf("Fence of the holder's term %d: %v", l.Term, err)
	}
	if _, err := tx.Exec(callCtx(t), `INSERT INTO fenced_writes VALUES ('alice, slow', $1)`, int64(l.Term)); err != nil {
		t.Fatal(err)
	}
	// The lease runs out, and stays unused for the advisory candidate's
	// TTL, after which a claim may move the name.
	electortest.Eventually(t, time.Minute, "the name to be free to move", func() bool {
		var free bool
		err := b.pool.QueryRow(callCtx(t), `SELECT expires_at + $2::interval < clock_timestamp() FROM leader_leases WHERE name = $1`,
			"report", advisoryTTL).Scan(&free)
		if err != nil {
			t.Fatal(err)
		}
		return free
	})
	type grant struct {
		l       leader.Lease
		granted bool
		err     error
	}
	took := make(chan grant, 1)
	go func() {
		l, granted, err := advisory.Acquire(callCtx(t), "report", candidate("bob"), advisoryTTL)
		took <- grant{l, granted, err}
	}()
	waitBlockedBy(t, b.pool, tx, "the advisory candidate's claim", func() {
		if len(took) > 0 {
			t.Fatalf("the advisory candidate returned while the fenced transaction was open: %+v", <-took)
		}
	})
	if err := tx.Commit(callCtx(t)); err != nil {
		t.Fatalf("commit of the fenced transaction: %v", err)
	}
	g := <-took
	if g.err != nil || !g.granted || g.l.Term != l.Term+1 {
		t.Fatalf("advisory grant after the commit: %+v, granted %v, %v; want term %d", g.l, g.granted, g.err, l.Term+1)
	}
	if !written(t, b.pool, "alice, slow") {
		t.Error("the fenced write committed before the move is not visible")
	}
	wantFenced(t, fencedWrite(t, b.pool, Options{}, "report", l.Term, "alice, later"), b.pool, l.Term, "alice, later")
	if err := fencedWrite(t, b.pool, Options{}, "report", g.l.Term, "bob"); err != nil {
		t.Fatalf("fenced write of the advisory holder's term %d: %v", g.l.Term, err)
	}
}

// pausable is a leader.Store that, once paused, lets no call reach the
// store: each blocks until its context ends. It is the store as the
// database sees that of a process stopped by SIGSTOP or a VM pause.
type pausable struct {
	leader.Store
	paused chan struct{}
}

func newPausable(s leader.Store) *pausable { return &pausable{Store: s, paused: make(chan struct{})} }

func (p *pausable) pause() { close(p.paused) }

func (p *pausable) hold(ctx context.Context) error {
	select {
	case <-p.paused:
		<-ctx.Done()
		return ctx.Err()
	default:
		return nil
	}
}

func (p *pausable) Acquire(ctx context.Context, name string, c leader.Candidate, ttl time.Duration) (leader.Lease, bool, error) {
	if err := p.hold(ctx); err != nil {
		return leader.Lease{}, false, err
	}
	return p.Store.Acquire(ctx, name, c, ttl)
}

func (p *pausable) Renew(ctx context.Context, name, token string, term uint64, ttl time.Duration) (leader.Lease, error) {
	if err := p.hold(ctx); err != nil {
		return leader.Lease{}, err
	}
	return p.Store.Renew(ctx, name, token, term, ttl)
}

func (p *pausable) Release(ctx context.Context, name, token string, term uint64) error {
	if err := p.hold(ctx); err != nil {
		return err
	}
	return p.Store.Release(ctx, name, token, term)
}

func (p *pausable) Observe(ctx context.Context, name string) (leader.Lease, error) {
	if err := p.hold(ctx); err != nil {
		return leader.Lease{}, err
	}
	return p.Store.Observe(ctx, name)
}

// pausableBatch is a pausable LeaseStore that renews in heartbeats, as the
// Electors of a process do.
type pausableBatch struct {
	*pausable
	batch leader.BatchRenewer
}

func (p pausableBatch) RenewBatch(ctx context.Context, batch []leader.Renewal) {
	if err := p.hold(ctx); err != nil {
		for i := range batch {
			batch[i].Err = err
		}
		return
	}
	p.batch.RenewBatch(ctx, batch)
}

// TestFenceRefusesAPausedLeader runs an Elector whose process is paused
// while it leads: the database hears nothing more from it, another
// instance is elected once its lease is gone, and the work the paused
// process then does with the term it was elected under is refused.
func TestFenceRefusesAPausedLeader(t *testing.T) {
	t.Parallel()
	for _, strategy := range []struct {
		name     string
		newStore func(t *testing.T, pool *pgxpool.Pool) leader.Store
		pausable func(s leader.Store) (leader.Store, func())
	}{
		{"lease", func(t *testing.T, pool *pgxpool.Pool) leader.Store {
			s, err := NewLeaseStore(pool, Options{})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(s.Close)
			return s
		}, func(s leader.Store) (leader.Store, func()) {
			p := newPausable(s)
			return pausableBatch{p, s.(leader.BatchRenewer)}, p.pause
		}},
		{"advisory", func(t *testing.T, pool *pgxpool.Pool) leader.Store {
			s, err := NewAdvisoryStore(callCtx(t), pool, Options{})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(s.Close)
			return s
		}, func(s leader.Store) (leader.Store, func()) {
			p := newPausable(s)
			return p, p.pause
		}},
	} {
		t.Run(strategy.name, func(t *testing.T) {
			t.Parallel()
			pool := pgtest.NewPool(t)
			if err := Migrate(callCtx(t), pool, Options{}); err != nil {
				t.Fatal(err)
			}
			mustExec(t, pool, fencedWrites)
			const name, ttl = "paused", time.Second
			elector := func(id string, store leader.Store) (*leader.Elector, <-chan uint64) {
				terms := make(chan uint64, 1)
				e, err := leader.New(store, leader.Config{Name: name, ID: id, TTL: ttl, Logger: slog.New(slog.DiscardHandler),
					OnElected: func(ctx context.Context) {
						term, _ := leader.TermFrom(ctx)
						select {
						case terms <- term:
						default: // elected again: the test reads the first term only
						}
					}})
				if err != nil {
					t.Fatal(err)
				}
				return e, terms
			}
			term := func(terms <-chan uint64, who string) uint64 {
				select {
				case term := <-terms:
					return term
				case <-time.After(30 * time.Second):
					t.Fatalf("%s was not elected", who)
					return 0
				}
			}

			aliceStore, pause := strategy.pausable(strategy.newStore(t, pool))
			alice, aliceTerms := elector("alice", aliceStore)
			electortest.Run(t, alice)
			old := term(aliceTerms, "alice")
			if err := fencedWrite(t, pool, Options{}, name, old, "alice, leading"); err != nil {
				// Seen once in CI (not reproduced in 6 runs alone): say
				// how the store and alice saw the lease then.
				l, oerr := strategy.newStore(t, pool).Observe(callCtx(t), name)
				t.Fatalf("fenced write of the leader's term %d: %v\nthe lease then: %+v (%v)\nalice's status: %+v", old, err, l, oerr, alice.Status())
			}

			pause()
			bob, bobTerms := elector("bob", strategy.newStore(t, pool))
			electortest.Run(t, bob)
			next := term(bobTerms, "bob")
			if next <= old {
				t.Fatalf("bob elected with term %d after alice's %d", next, old)
			}
			// Alice's process resumes and carries on with the work it
			// was doing under its term.
			wantFenced(t, fencedWrite(t, pool, Options{}, name, old, "alice, resumed"), pool, old, "alice, resumed")
			if err := fencedWrite(t, pool, Options{}, name, next, "bob, leading"); err != nil {
				t.Fatalf("fenced write of the new leader's term %d: %v", next, err)
			}
		})
	}
}

// TestFenceFunctionForChildren calls the fence function as a program in
// another language does, such as a child of the leader command that knows
// LEADER_NAME and LEADER_TERM: on a connection of its own, in one script
// sent with the simple query protocol (as psql -c sends it), and with psql
// itself where it is installed, as the package documentation shows.
func TestFenceFunctionForChildren(t *testing.T) {
	t.Parallel()
	b := setup(t)
	mustExec(t, b.pool, fencedWrites)
	alice := candidate("alice")
	// Long: the parallel subtests may wait their turn for minutes on a
	// busy machine.
	l := mustGrant(t, b.store, "report", alice, time.Hour)
	if got := FenceFunction(Options{}); got != `"public"."leader_leases_fence"` {
		t.Errorf("FenceFunction(Options{}) = %s", got)
	}
	script := func(term uint64, note string) string {
		return fmt.Sprintf(`BEGIN; SELECT leader_leases_fence('report', %d); INSERT INTO fenced_writes VALUES ('%s', %d); COMMIT;`, term, note, term)
	}
	url := b.pool.Config().ConnConfig.ConnString()

	t.Run("on a connection of its own", func(t *testing.T) {
		t.Parallel()
		conn, err := pgx.Connect(callCtx(t), url)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(context.Background())
		if _, err := conn.PgConn().Exec(callCtx(t), script(l.Term, "child")).ReadAll(); err != nil {
			t.Fatalf("the holder's fenced script: %v", err)
		}
		if !written(t, b.pool, "child") {
			t.Fatal("the holder's fenced write is not visible")
		}

		_, err = conn.PgConn().Exec(callCtx(t), script(l.Term+1, "child, wrong term")).ReadAll()
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != FenceSQLState {
			t.Fatalf("fenced script of a term that does not hold the lease: %v; want SQLSTATE %s", err, FenceSQLState)
		}
		wantMsg := fmt.Sprintf("term %d does not hold the lease of election 'report'", l.Term+1)
		wantDetail := fmt.Sprintf("Term %d holds it now (lease strategy).", l.Term)
		if pgErr.Message != wantMsg || pgErr.Detail != wantDetail || pgErr.Hint == "" {
			t.Errorf("the refusal says %q, detail %q, hint %q; want %q, detail %q and a hint", pgErr.Message, pgErr.Detail, pgErr.Hint, wantMsg, wantDetail)
		}
		if written(t, b.pool, "child, wrong term") {
			t.Error("the write of the refused script is visible")
		}
		// The script stopped at the error, inside its transaction, which
		// the child ends (psql ends it by exiting).
		if _, err := conn.Exec(callCtx(t), "SELECT 1"); sqlState(err) != "25P02" {
			t.Errorf("the child's connection after the refusal: %v; want its transaction aborted (SQLSTATE 25P02)", err)
		}
		if _, err := conn.Exec(callCtx(t), "ROLLBACK"); err != nil {
			t.Fatal(err)
		}
		if written(t, b.pool, "child, wrong term") {
			t.Error("the write of the refused script is visible after the rollback")
		}
	})

	t.Run("with psql", func(t *testing.T) {
		t.Parallel()
		psql, err := exec.LookPath("psql")
		if err != nil {
			t.Skip("psql is not installed")
		}
		// As the package documentation shows it: the name and the term
		// in psql's variables, the script on stdin.
		const stdin = `BEGIN;
SELECT leader_leases_fence(:'name', :term);
INSERT INTO fenced_writes VALUES (:'note', :term);
COMMIT;
`
		run := func(term uint64, note string) (string, error) {
			cmd := exec.CommandContext(callCtx(t), psql, url, "-X", "-q", "-v", "ON_ERROR_STOP=1",
				"-v", "name=report", "-v", fmt.Sprint("term=", term), "-v", "note="+note)
			cmd.Stdin = strings.NewReader(stdin)
			out, err := cmd.CombinedOutput()
			return string(out), err
		}
		if out, err := run(l.Term, "psql, it's mine"); err != nil || !written(t, b.pool, "psql, it's mine") {
			t.Fatalf("psql with the holder's term: %v\n%s", err, out)
		}
		out, err := run(l.Term+1, "psql, wrong term")
		if err == nil || !strings.Contains(out, "does not hold the lease") {
			t.Fatalf("psql with a term that does not hold the lease: %v\n%s; want a failure that says why", err, out)
		}
		if written(t, b.pool, "psql, wrong term") {
			t.Error("the write of the refused psql script is visible")
		}
		// And the one-line form, for names without quotes.
		oneLine, err := exec.CommandContext(callCtx(t), psql, url, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-c", script(l.Term, "psql -c")).CombinedOutput()
		if err != nil || !written(t, b.pool, "psql -c") {
			t.Fatalf("psql -c with the holder's term: %v\n%s", err, oneLine)
		}
	})
}

// TestFenceOnOddNames fences with Options whose names need quoting, one
// containing the function body's dollar quote, and in a schema of their
// own.
func TestFenceOnOddNames(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	opts := Options{Schema: `fence "Odd"`, Table: `leases $fence$ 'x'`, HeartbeatTable: `beats $fence1$`}
	b := setupOn(t, pool, opts)
	if err := Migrate(callCtx(t), pool, opts); err != nil {
		t.Fatalf("Migrate again: %v", err)
	}
	if got, want := FenceFunction(opts), `"fence ""Odd"""."leases $fence$ 'x'_fence"`; got != want {
		t.Errorf("FenceFunction = %s, want %s", got, want)
	}
	mustExec(t, pool, fencedWrites)
	alice := candidate("alice")
	l := mustGrant(t, b.store, "report", alice, time.Minute)
	mustRenewBatch(t, b.store, renewals(alice, time.Minute, l))
	if err := fencedWrite(t, pool, opts, "report", l.Term, "odd"); err != nil {
		t.Fatalf("fenced write of the holder's term: %v", err)
	}
	mustRelease(t, b.store, "report", alice, l.Term)
	wantFenced(t, fencedWrite(t, pool, opts, "report", l.Term, "odd, released"), pool, l.Term, "odd, released")
}

// TestFenceErrors checks Fence's refusals that are not the lease's: bad
// Options, and a database that was not migrated with the fence function.
func TestFenceErrors(t *testing.T) {
	t.Parallel()
	b := setup(t)
	tx, err := b.pool.Begin(callCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	var oe *OptionsError
	if err := Fence(callCtx(t), tx, Options{Table: strings.Repeat("t", 64)}, "report", 1); !errors.As(err, &oe) {
		t.Errorf("Fence with a bad Table: %v; want an *OptionsError", err)
	}

	mustExec(t, b.pool, `DROP FUNCTION public.leader_leases_fence(text, bigint)`)
	err = Fence(callCtx(t), tx, Options{}, "report", 1)
	if !errors.Is(err, leader.ErrPermanent) || !strings.Contains(err.Error(), "migrate") || errors.Is(err, leader.ErrLeaseLost) {
		t.Errorf("Fence without the function: %v; want an error wrapping leader.ErrPermanent that says to migrate", err)
	}
}
