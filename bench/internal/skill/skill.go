// Package skill is the table-and-heartbeat elector of the widely copied
// "leader-election" skill (see "The electors" in bench/README.md),
// written in Go from its description for the benchmark: a
// leader_election table, three SQL functions (try_become_leader,
// leader_heartbeat, step_down) and a loop that every HeartbeatInterval
// either heartbeats (the leader) or tries to become leader (a follower).
//
// It keeps the original's behaviour on purpose, weaknesses included, so
// that the benchmark measures the algorithm people copy:
//
//   - followers poll: a released or expired lease is taken only at a
//     follower's next tick, up to HeartbeatInterval later;
//   - the timeout is whole seconds, judged on the row's last_heartbeat
//     against the database's now() (the transaction's start);
//   - the leader never checks a deadline of its own: it believes it leads
//     until a heartbeat statement returns false or fails;
//   - candidates are told apart by their human-readable ID, so two
//     instances with one ID both lead;
//   - step_down deletes the row, so the next leader starts again at
//     term 1 (terms go back), and the term is never handed to the
//     leader's work (no fencing).
package skill

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Schema creates the table and the functions, as the skill's migration
// does (CREATE OR REPLACE, so it may run more than once; the table is
// created only if missing).
const Schema = `
CREATE TABLE IF NOT EXISTS leader_election (
	service_name VARCHAR(255) PRIMARY KEY,
	leader_id VARCHAR(255) NOT NULL,
	term INTEGER NOT NULL DEFAULT 1,
	last_heartbeat TIMESTAMPTZ NOT NULL DEFAULT NOW(),
	metadata JSONB DEFAULT '{}'
);

CREATE OR REPLACE FUNCTION try_become_leader(
	p_service_name VARCHAR(255),
	p_candidate_id VARCHAR(255),
	p_timeout_seconds INTEGER DEFAULT 30
) RETURNS BOOLEAN AS $$
DECLARE
	v_now TIMESTAMPTZ := NOW();
	v_timeout TIMESTAMPTZ := v_now - (p_timeout_seconds || ' seconds')::INTERVAL;
	v_current RECORD;
BEGIN
	SELECT * INTO v_current FROM leader_election
	WHERE service_name = p_service_name
	FOR UPDATE;

	IF NOT FOUND THEN
		INSERT INTO leader_election (service_name, leader_id, term, last_heartbeat)
		VALUES (p_service_name, p_candidate_id, 1, v_now);
		RETURN TRUE;
	END IF;

	IF v_current.leader_id = p_candidate_id THEN
		UPDATE leader_election SET last_heartbeat = v_now
		WHERE service_name = p_service_name;
		RETURN TRUE;
	END IF;

	IF v_current.last_heartbeat < v_timeout THEN
		UPDATE leader_election
		SET leader_id = p_candidate_id, term = term + 1, last_heartbeat = v_now
		WHERE service_name = p_service_name;
		RETURN TRUE;
	END IF;

	RETURN FALSE;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION leader_heartbeat(
	p_service_name VARCHAR(255),
	p_leader_id VARCHAR(255)
) RETURNS BOOLEAN AS $$
BEGIN
	UPDATE leader_election SET last_heartbeat = NOW()
	WHERE service_name = p_service_name AND leader_id = p_leader_id;
	RETURN FOUND;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION step_down(
	p_service_name VARCHAR(255),
	p_leader_id VARCHAR(255)
) RETURNS BOOLEAN AS $$
BEGIN
	DELETE FROM leader_election
	WHERE service_name = p_service_name AND leader_id = p_leader_id;
	RETURN FOUND;
END;
$$ LANGUAGE plpgsql;
`

// The skill's defaults.
const (
	DefaultHeartbeatInterval       = 10 * time.Second
	DefaultHeartbeatTimeoutSeconds = 30
)

// Config is the skill's LeaderElectionConfig.
type Config struct {
	ServiceName string
	CandidateID string
	// HeartbeatInterval is the period of the loop, for the leader's
	// heartbeat and for the followers' attempts alike. Default 10s.
	HeartbeatInterval time.Duration
	// HeartbeatTimeoutSeconds is how old the last heartbeat must be for a
	// follower to take over. Default 30.
	HeartbeatTimeoutSeconds int
	OnBecomeLeader          func()
	OnLoseLeadership        func()
	// Logger receives what the original prints with console.log and
	// console.error. Default slog.Default().
	Logger *slog.Logger
}

// LeaderElection is the skill's LeaderElection class.
type LeaderElection struct {
	db  *pgxpool.Pool
	cfg Config

	mu       sync.Mutex
	isLeader bool
	running  bool
	stopLoop context.CancelFunc
	loopDone chan struct{}
}

// New returns an elector on db with cfg's zero fields set to the skill's
// defaults.
func New(db *pgxpool.Pool, cfg Config) *LeaderElection {
	if cfg.HeartbeatInterval == 0 {
		cfg.HeartbeatInterval = DefaultHeartbeatInterval
	}
	if cfg.HeartbeatTimeoutSeconds == 0 {
		cfg.HeartbeatTimeoutSeconds = DefaultHeartbeatTimeoutSeconds
	}
	if cfg.OnBecomeLeader == nil {
		cfg.OnBecomeLeader = func() {}
	}
	if cfg.OnLoseLeadership == nil {
		cfg.OnLoseLeadership = func() {}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &LeaderElection{db: db, cfg: cfg}
}

// Start tries to become leader once, then starts the heartbeat loop
// (setInterval in the original: a tick every HeartbeatInterval, counted
// from Start, whatever the previous tick took).
func (l *LeaderElection) Start(ctx context.Context) {
	l.mu.Lock()
	if l.running {
		l.mu.Unlock()
		return
	}
	l.running = true
	l.mu.Unlock()

	l.tryBecomeLeader(ctx)

	loopCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	done := make(chan struct{})
	l.mu.Lock()
	l.stopLoop, l.loopDone = cancel, done
	l.mu.Unlock()
	go func() {
		defer close(done)
		tick := time.NewTicker(l.cfg.HeartbeatInterval)
		defer tick.Stop()
		for {
			select {
			case <-loopCtx.Done():
				return
			case <-tick.C:
				// A tick already running is not cut short by Stop.
				l.heartbeatLoop(context.WithoutCancel(loopCtx))
			}
		}
	}()
}

// Stop stops the loop and, if leading, steps down (deleting the row).
func (l *LeaderElection) Stop(ctx context.Context) {
	l.mu.Lock()
	l.running = false
	stop, done := l.stopLoop, l.loopDone
	l.stopLoop, l.loopDone = nil, nil
	leading := l.isLeader
	l.mu.Unlock()
	if stop != nil {
		// clearInterval: no tick after this one. (The original lets a tick
		// already running finish on its own; here Stop waits for it.)
		stop()
		<-done
	}
	if leading {
		l.stepDown(ctx)
	}
}

// IsCurrentLeader reports whether this instance believes it leads.
func (l *LeaderElection) IsCurrentLeader() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.isLeader
}

func (l *LeaderElection) tryBecomeLeader(ctx context.Context) bool {
	var became bool
	err := l.db.QueryRow(ctx, "SELECT try_become_leader($1, $2, $3)",
		l.cfg.ServiceName, l.cfg.CandidateID, l.cfg.HeartbeatTimeoutSeconds).Scan(&became)
	if err != nil {
		l.cfg.Logger.Error("[LeaderElection] Error", slog.Any("error", err))
		return false
	}
	l.mu.Lock()
	newly := became && !l.isLeader
	if newly {
		l.isLeader = true
	}
	l.mu.Unlock()
	if newly {
		l.cfg.Logger.Info("[LeaderElection] became leader", slog.String("candidate", l.cfg.CandidateID))
		l.cfg.OnBecomeLeader()
	}
	return became
}

func (l *LeaderElection) sendHeartbeat(ctx context.Context) bool {
	var ok bool
	err := l.db.QueryRow(ctx, "SELECT leader_heartbeat($1, $2)", l.cfg.ServiceName, l.cfg.CandidateID).Scan(&ok)
	return err == nil && ok
}

func (l *LeaderElection) stepDown(ctx context.Context) {
	if !l.IsCurrentLeader() {
		return
	}
	// The original ignores the outcome of the call.
	_, _ = l.db.Exec(ctx, "SELECT step_down($1, $2)", l.cfg.ServiceName, l.cfg.CandidateID)
	l.mu.Lock()
	l.isLeader = false
	l.mu.Unlock()
	l.cfg.Logger.Info("[LeaderElection] stepped down", slog.String("candidate", l.cfg.CandidateID))
	l.cfg.OnLoseLeadership()
}

func (l *LeaderElection) heartbeatLoop(ctx context.Context) {
	l.mu.Lock()
	running, leading := l.running, l.isLeader
	l.mu.Unlock()
	if !running {
		return
	}
	if leading {
		if !l.sendHeartbeat(ctx) {
			l.mu.Lock()
			l.isLeader = false
			l.mu.Unlock()
			l.cfg.Logger.Info("[LeaderElection] Lost leadership")
			l.cfg.OnLoseLeadership()
		}
		return
	}
	l.tryBecomeLeader(ctx)
}
