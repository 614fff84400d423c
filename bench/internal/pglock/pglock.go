// Package pglock is a client-go resourcelock.Interface on a PostgreSQL
// table, for running client-go's LeaderElector against the same database
// as the other electors of the benchmark.
//
// It does what the Kubernetes API server does for a Lease object: the
// record is stored whole with a version (the resourceVersion), Get reads
// both, Create inserts only if no record exists (else AlreadyExists), and
// Update is a compare-and-swap on the version this lock last read or wrote
// (else Conflict). The errors are Kubernetes API errors, which is what the
// LeaderElector tests for. Each call is one SQL statement.
package pglock

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"
	rl "k8s.io/client-go/tools/leaderelection/resourcelock"
)

// Schema creates the lock table.
const Schema = `
CREATE TABLE IF NOT EXISTS k8s_leader_locks (
	name text PRIMARY KEY,
	record text NOT NULL,
	version bigint NOT NULL
)`

var leases = schema.GroupResource{Group: "coordination.k8s.io", Resource: "leases"}

// Lock is one candidate's lock on one record. It is safe for concurrent
// use, though a LeaderElector calls it from one goroutine at a time.
type Lock struct {
	pool     *pgxpool.Pool
	name     string
	identity string

	// AfterCall, if set, is called after each Get, Create and Update.
	AfterCall func()

	mu      sync.Mutex
	version int64 // last read or written; 0 before the first Get or Create
}

var _ rl.Interface = (*Lock)(nil)

// New returns the lock on record name for the candidate identity.
func New(pool *pgxpool.Pool, name, identity string) *Lock {
	return &Lock{pool: pool, name: name, identity: identity}
}

func (l *Lock) after() {
	if l.AfterCall != nil {
		l.AfterCall()
	}
}

// Get returns the record, its JSON as stored, and remembers its version.
func (l *Lock) Get(ctx context.Context) (*rl.LeaderElectionRecord, []byte, error) {
	defer l.after()
	var (
		raw     string
		version int64
	)
	err := l.pool.QueryRow(ctx, "SELECT record, version FROM k8s_leader_locks WHERE name = $1", l.name).Scan(&raw, &version)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil, apierrors.NewNotFound(leases, l.name)
	}
	if err != nil {
		return nil, nil, err
	}
	var rec rl.LeaderElectionRecord
	if err := json.Unmarshal([]byte(raw), &rec); err != nil {
		return nil, nil, fmt.Errorf("pglock: record %q: %w", l.name, err)
	}
	l.mu.Lock()
	l.version = version
	l.mu.Unlock()
	return &rec, []byte(raw), nil
}

// Create stores the first record, or fails with AlreadyExists.
func (l *Lock) Create(ctx context.Context, ler rl.LeaderElectionRecord) error {
	defer l.after()
	raw, err := json.Marshal(ler)
	if err != nil {
		return err
	}
	var version int64
	err = l.pool.QueryRow(ctx, `
INSERT INTO k8s_leader_locks (name, record, version) VALUES ($1, $2, 1)
ON CONFLICT (name) DO NOTHING
RETURNING version`, l.name, string(raw)).Scan(&version)
	if errors.Is(err, pgx.ErrNoRows) {
		return apierrors.NewAlreadyExists(leases, l.name)
	}
	if err != nil {
		return err
	}
	l.mu.Lock()
	l.version = version
	l.mu.Unlock()
	return nil
}

// Update replaces the record if its version is still the one this lock
// last read or wrote, or fails with Conflict.
func (l *Lock) Update(ctx context.Context, ler rl.LeaderElectionRecord) error {
	defer l.after()
	l.mu.Lock()
	expected := l.version
	l.mu.Unlock()
	if expected == 0 {
		return errors.New("pglock: record not initialized, call Get or Create first")
	}
	raw, err := json.Marshal(ler)
	if err != nil {
		return err
	}
	var version int64
	err = l.pool.QueryRow(ctx, `
UPDATE k8s_leader_locks SET record = $2, version = version + 1
WHERE name = $1 AND version = $3
RETURNING version`, l.name, string(raw), expected).Scan(&version)
	if errors.Is(err, pgx.ErrNoRows) {
		return apierrors.NewConflict(leases, l.name, fmt.Errorf("version %d is no longer current", expected))
	}
	if err != nil {
		return err
	}
	l.mu.Lock()
	l.version = version
	l.mu.Unlock()
	return nil
}

// RecordEvent does nothing: there is no event sink.
func (l *Lock) RecordEvent(string) {}

// Identity returns the candidate's identity.
func (l *Lock) Identity() string { return l.identity }

// Describe names the lock in client-go's logs.
func (l *Lock) Describe() string { return "postgres/k8s_leader_locks/" + l.name }
