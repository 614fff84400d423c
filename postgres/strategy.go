package postgres

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
)

// Strategy names how an election name is elected on PostgreSQL: with the
// lease table (LeaseStore) or with an advisory lock (AdvisoryStore). A name
// is elected with one strategy at a time; see "One strategy per name" in
// the package documentation.
type Strategy string

const (
	// StrategyLease is LeaseStore's strategy: a lease row with an expiry.
	StrategyLease Strategy = "lease"
	// StrategyAdvisory is AdvisoryStore's strategy: a session advisory lock.
	StrategyAdvisory Strategy = "advisory"
)

// other returns the strategy that is not s.
func (s Strategy) other() Strategy {
	if s == StrategyLease {
		return StrategyAdvisory
	}
	return StrategyLease
}

// StrategyConflictError is the error (wrapped) of a store's Acquire for a
// name that the other strategy uses: its lease is held there now (Held),
// or was held or released there within the last TTL. Nothing was granted.
//
// While the other strategy holds the name, it wraps leader.ErrPermanent, so
// an Elector's Run returns it at once if it comes before any store call
// succeeded: candidates of both strategies for one name at once are a
// misconfiguration, and a loud one. Otherwise the name is moving to this
// strategy (its old candidates were stopped), and the Elector retries like
// after any refusal: it is granted the name once a TTL has passed, at
// Until. So to move a name from one strategy to the other, stop every
// candidate of the old strategy, then start the new ones.
type StrategyConflictError struct {
	Name  string   // the election name
	Want  Strategy // the strategy of the candidate that was refused
	InUse Strategy // the strategy that uses the name
	// Held says that the lease is held under InUse now; otherwise it was
	// held or released within the last TTL, and Until is when the name
	// can move, on the server's clock.
	Held  bool
	Until time.Time
}

// Error names the name, both strategies, and what to do.
func (e *StrategyConflictError) Error() string {
	why := "its lease is held there now"
	if !e.Held {
		why = "its lease was held or released there less than a TTL ago; it can move to the " + string(e.Want) +
			" strategy at " + e.Until.UTC().Format(time.RFC3339Nano) + " on the server's clock"
	}
	return fmt.Sprintf("election %q is elected with the %s strategy (%s), and this candidate uses the %s strategy: a name must be elected with one strategy only; "+
		"to move it to the %s strategy, stop every %s candidate of it, then start the %s ones",
		e.Name, e.InUse, why, e.Want, e.Want, e.InUse, e.Want)
}

// Unwrap returns leader.ErrPermanent while the other strategy holds the
// name, and nil otherwise.
func (e *StrategyConflictError) Unwrap() error {
	if e.Held {
		return leader.ErrPermanent
	}
	return nil
}

// errNotClaimed is a grant's error when the strategy table does not give
// the name to the grant's strategy: the caller claims it (claimStrategy).
var errNotClaimed = errors.New("the election name is not claimed by this strategy")

// errStrategyMoved is Acquire's error when a name it claimed moved to the
// other strategy before its grant: retried like an unavailable store.
var errStrategyMoved = errors.New("the election name moved to the other strategy while this candidate claimed it")

// claimStrategy makes want the strategy of name, in a transaction of its
// own, if the other strategy neither holds the name's lease now nor held
// or released it within the last TTL (the larger of ttl and the lease's
// own, where the table records it). Otherwise it returns a
// *StrategyConflictError. It is called by a candidate whose grant found the
// name's row of the strategy table missing or naming the other strategy.
//
// It first locks the name's row (inserting it if missing), and only then,
// in a later statement whose snapshot is taken after the lock, looks at the
// other strategy's lease: a grant of the other strategy holds the row FOR
// KEY SHARE until it commits, so the claim either waits for it and sees
// it, or comes first and makes it refuse. When the name moves, term_floor
// is raised to the other strategy's term, so that the next grant's term is
// above every term of the name. A lease whose last holder went without a
// release, at an unknown time (an advisory holder whose session ended, or
// a release recorded before released_at existed), is taken as used until
// a TTL after a claim first saw it so (idle_seen_at).
func claimStrategy(ctx context.Context, pool *pgxpool.Pool, opts Options, name string, want Strategy, ttl time.Duration) error {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // a no-op after Commit

	table := opts.qualifiedStrategyTable()
	var inserted bool
	err = tx.QueryRow(ctx, `INSERT INTO `+table+` AS s (name, strategy, since) VALUES ($1, $2, clock_timestamp())
		ON CONFLICT (name) DO NOTHING RETURNING true`, name, string(want)).Scan(&inserted)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return err
	}
	var (
		current  Strategy
		idleSeen *time.Time
	)
	err = tx.QueryRow(ctx, `SELECT s.strategy, s.idle_seen_at FROM `+table+` AS s WHERE s.name = $1 FOR UPDATE`, name).
		Scan(&current, &idleSeen)
	if err != nil {
		return err
	}
	if current == want && !inserted {
		return nil // another candidate of this strategy claimed it meanwhile
	}
	u, err := lookAtUse(ctx, tx, opts, name, want.other())
	if err != nil {
		return err
	}
	wait := max(ttl, u.ttl)
	conflict := &StrategyConflictError{Name: name, Want: want, InUse: want.other(), Held: u.held}
	switch {
	case u.held:
		return conflict // rolls back: a row inserted here goes too
	case u.lastUsed != nil:
		if until := u.lastUsed.Add(wait); until.After(u.now) {
			conflict.Until = until
			return conflict
		}
	case u.used:
		// Gone without a known release time: wait a TTL from when a
		// claim first saw it so, and record that moment (the name stays
		// the other strategy's meanwhile).
		if idleSeen == nil {
			idleSeen = &u.now
			if _, err := tx.Exec(ctx, `UPDATE `+table+` SET strategy = $2, idle_seen_at = $3 WHERE name = $1`,
				name, string(want.other()), u.now); err != nil {
				return err
			}
		}
		if until := idleSeen.Add(wait); until.After(u.now) {
			conflict.Until = until
			if err := tx.Commit(ctx); err != nil {
				return err
			}
			return conflict
		}
	}
	if _, err := tx.Exec(ctx, `UPDATE `+table+` SET strategy = $2, since = clock_timestamp(), term_floor = greatest(term_floor, $3), idle_seen_at = NULL
		WHERE name = $1`, name, string(want), u.term); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// use is what claimStrategy learns of a strategy's lease of a name.
type use struct {
	used     bool       // the strategy has a row for the name
	held     bool       // its lease is held now
	lastUsed *time.Time // when it was last held or released, if known
	term     int64      // its last term
	ttl      time.Duration
	now      time.Time // the server's clock
}

// lookAtUse reads strategy's lease of name, on the server's clock.
func lookAtUse(ctx context.Context, tx pgx.Tx, opts Options, name string, strategy Strategy) (use, error) {
	var (
		u   use
		ttl *time.Duration
	)
	var q string
	switch strategy {
	case StrategyAdvisory:
		// Held while any backend holds the lock (its key's halves as
		// pg_locks shows them: see advisoryStatements); released at
		// released_at; otherwise gone at an unknown time.
		q = `SELECT true, EXISTS (` + heldBy("((a.key >> 32) & 4294967295)", "(a.key & 4294967295)") + `),
			CASE WHEN a.holder_token IS NULL THEN a.released_at END, a.term, a.ttl, c.now
		FROM ` + opts.qualifiedAdvisoryTable() + ` AS a, clock_timestamp() AS c(now) WHERE a.name = $1`
	default:
		// Held while unexpired under its own expiry or its heartbeat's;
		// last used at its release, or at that expiry, which a dead
		// heartbeat's row still records.
		hb := opts.qualifiedHeartbeatTable()
		q = `SELECT true, ` + heldAt(hb, "c.now") + `,
			CASE WHEN l.holder_token IS NULL THEN l.released_at
				WHEN l.heartbeat IS NULL THEN l.expires_at
				ELSE (SELECT h.expires_at FROM ` + hb + ` AS h WHERE h.id = l.heartbeat) END,
			l.term, NULL::interval, c.now
		FROM ` + opts.qualifiedTable() + ` AS l, clock_timestamp() AS c(now) WHERE l.name = $1`
	}
	err := tx.QueryRow(ctx, q, name).Scan(&u.used, &u.held, &u.lastUsed, &u.term, &ttl, &u.now)
	if errors.Is(err, pgx.ErrNoRows) {
		return use{}, nil // never used: nothing to wait for
	}
	if ttl != nil {
		u.ttl = *ttl
	}
	return u, err
}

// StrategyOf returns the strategy that name is elected with on the
// database of pool, as the strategy table records it; for a name that no
// grant has recorded there (one last granted by a version of this package
// from before the table), the strategy whose table holds its lease, or
// else has a row for it; and "" for a name never elected. Tools use it to
// show a name's leader without being told the strategy (the leader
// command's status and watch). opts must be those of Migrate; it returns
// an *OptionsError if they break a rule.
func StrategyOf(ctx context.Context, pool *pgxpool.Pool, opts Options, name string) (Strategy, error) {
	opts = opts.withDefaults()
	if err := opts.validate(); err != nil {
		return "", err
	}
	ctx, cancel := opts.bound(ctx)
	defer cancel()
	hb := opts.qualifiedHeartbeatTable()
	var strategy string
	err := pool.QueryRow(ctx, `SELECT coalesce(
		(SELECT s.strategy FROM `+opts.qualifiedStrategyTable()+` AS s WHERE s.name = $1),
		CASE
			WHEN EXISTS (SELECT FROM `+opts.qualifiedAdvisoryTable()+` AS a WHERE a.name = $1
				AND EXISTS (`+heldBy("((a.key >> 32) & 4294967295)", "(a.key & 4294967295)")+`)) THEN 'advisory'
			WHEN EXISTS (SELECT FROM `+opts.qualifiedTable()+` AS l WHERE l.name = $1 AND `+heldAt(hb, "clock_timestamp()")+`) THEN 'lease'
			WHEN EXISTS (SELECT FROM `+opts.qualifiedTable()+` AS l WHERE l.name = $1) THEN 'lease'
			WHEN EXISTS (SELECT FROM `+opts.qualifiedAdvisoryTable()+` AS a WHERE a.name = $1) THEN 'advisory'
			ELSE ''
		END)`, name).Scan(&strategy)
	if err != nil {
		return "", wrapError(ctx, call("find the strategy of", name), err)
	}
	return Strategy(strategy), nil
}
