// Package fenced is a fenced resource in PostgreSQL, the downstream end of
// DESIGN.md invariant 2: a table of registers, each holding the greatest
// term that wrote it and a value, that accepts a write only if its term is
// at least that greatest term. Leaders under test write to it with the term
// of their leadership; a deposed leader's late write carries a smaller term
// than its successor's and is refused.
//
// Every write and read made through a Register is recorded with its
// invocation and return times (CLOCK_MONOTONIC, package monotime, so the
// records of several processes on one host can be merged), and
// CheckLinearizable checks the record against the model of a fenced
// register with porcupine. A history passes only if every accepted write
// carried a term no smaller than that of every write accepted before it,
// every refused write a smaller one, and every read saw the latest accepted
// write, for some order of the operations consistent with their times.
package fenced

import (
	"bufio"
	"bytes"
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/leaderelect/leader/internal/monotime"
)

// DB is what a Register needs of a connection: *pgxpool.Pool, *pgx.Conn
// and pgx.Tx all have it. Each caller may pass its own (a leader under test
// writes through its own connections).
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Kind says whether an Op wrote or read.
type Kind string

// The kinds of operations.
const (
	Write Kind = "write"
	Read  Kind = "read"
)

// Op is one recorded operation on one register (a resource).
type Op struct {
	// ID identifies the operation among all processes' records.
	ID string `json:"id"`
	// Kind is Write or Read.
	Kind Kind `json:"kind"`
	// Resource names the register.
	Resource string `json:"resource"`
	// Client names who made the operation: the writer of a write.
	Client string `json:"client"`
	// Term and Value are a write's arguments, and what a read returned.
	Term  uint64 `json:"term"`
	Value string `json:"value"`
	// Accepted reports whether a write was accepted.
	Accepted bool `json:"accepted"`
	// Invoke and Return are CLOCK_MONOTONIC readings in nanoseconds from
	// just before the statement was sent and just after its result came.
	Invoke int64 `json:"invoke"`
	Return int64 `json:"return"`
	// Unknown reports that the outcome is not known: the statement failed
	// (its transaction may still have committed) or the process died
	// before it returned. Return is then meaningless.
	Unknown bool `json:"unknown,omitempty"`
	// Err is the failure, when Unknown.
	Err string `json:"err,omitempty"`
}

func (op Op) String() string {
	var out string
	switch {
	case op.Unknown:
		out = "unknown (" + op.Err + ")"
	case op.Kind == Read:
		out = fmt.Sprintf("(%d, %q)", op.Term, op.Value)
	case op.Accepted:
		out = "accepted"
	default:
		out = "refused"
	}
	if op.Kind == Read {
		return fmt.Sprintf("%s read %s -> %s [%d, %d]", op.Client, op.Resource, out, op.Invoke, op.Return)
	}
	return fmt.Sprintf("%s write %s term %d %q -> %s [%d, %d]", op.Client, op.Resource, op.Term, op.Value, out, op.Invoke, op.Return)
}

// Register reads and writes the fenced registers of one table, recording
// every operation. Its methods are safe for concurrent use.
type Register struct {
	table  string // quoted
	prefix string // of operation IDs: unique to this Register
	seq    atomic.Uint64

	mu  sync.Mutex
	ops []Op
	log *os.File // nil unless LogTo
}

// Setup creates the table name (quoted, in the connection's default schema)
// if it does not exist, and returns a Register on it.
func Setup(ctx context.Context, db DB, name string) (*Register, error) {
	r, err := Open(name)
	if err != nil {
		return nil, err
	}
	_, err = db.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+r.table+` (
		resource text PRIMARY KEY,
		term bigint NOT NULL CHECK (term >= 0),
		writer text NOT NULL,
		value text NOT NULL
	)`)
	if err != nil {
		return nil, fmt.Errorf("fenced: creating table %s: %w", r.table, err)
	}
	return r, nil
}

// Open returns a Register on the table name, which Setup created, for
// instance in another process.
func Open(name string) (*Register, error) {
	if name == "" {
		return nil, errors.New("fenced: table name is empty")
	}
	var b [6]byte
	if _, err := crand.Read(b[:]); err != nil {
		return nil, fmt.Errorf("fenced: %w", err)
	}
	return &Register{
		table:  pgx.Identifier{name}.Sanitize(),
		prefix: fmt.Sprintf("%d-%s-", os.Getpid(), hex.EncodeToString(b[:])),
	}, nil
}

// fileSuffix ends the name of every operation log; LoadOps reads only
// those.
const fileSuffix = ".fenced.jsonl"

// LogTo makes the Register also append every operation to a new file in
// dir, for LoadOps: one line when it is invoked and one when it returns,
// each in one write(2) with O_APPEND, so that a process killed with SIGKILL
// leaves complete lines and its operations in flight show as Unknown.
func (r *Register) LogTo(dir string) error {
	path := filepath.Join(dir, strings.TrimSuffix(r.prefix, "-")+fileSuffix)
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("fenced: %w", err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.log != nil {
		r.log.Close()
	}
	r.log = f
	return nil
}

// Close closes the file LogTo opened, if any.
func (r *Register) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.log == nil {
		return nil
	}
	err := r.log.Close()
	r.log = nil
	return err
}

// History returns the operations made through this Register so far, in the
// order they were invoked, those still in flight included as Unknown.
func (r *Register) History() []Op {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.ops)
}

// begin records op as invoked now and returns its index.
func (r *Register) begin(op *Op) (int, error) {
	op.ID = r.prefix + fmt.Sprint(r.seq.Add(1))
	now, err := monotime.Now()
	if err != nil {
		return 0, fmt.Errorf("fenced: %w", err)
	}
	op.Invoke = now
	op.Unknown = true // until it returns
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.logLocked(*op); err != nil {
		return 0, err
	}
	r.ops = append(r.ops, *op)
	return len(r.ops) - 1, nil
}

// end records how the operation at i returned.
func (r *Register) end(i int, op Op, err error) error {
	if err != nil {
		op.Unknown, op.Err = true, err.Error()
	} else {
		now, cerr := monotime.Now()
		if cerr != nil {
			return fmt.Errorf("fenced: %w", cerr)
		}
		op.Return, op.Unknown = now, false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ops[i] = op
	return r.logLocked(op)
}

func (r *Register) logLocked(op Op) error {
	if r.log == nil {
		return nil
	}
	line, err := json.Marshal(op)
	if err != nil {
		return fmt.Errorf("fenced: %w", err)
	}
	if _, err := r.log.Write(append(line, '\n')); err != nil {
		return fmt.Errorf("fenced: logging %v: %w", op, err)
	}
	return nil
}

// Write sets resource to (term, value), on behalf of writer, if term is at
// least the greatest term that resource has seen (a resource never written
// has seen 0), and reports whether it did. It is one statement, atomic on
// the server. If it fails, the write may or may not have taken effect; it
// is recorded as Unknown.
func (r *Register) Write(ctx context.Context, db DB, resource string, term uint64, writer, value string) (accepted bool, err error) {
	if term > math.MaxInt64 {
		return false, fmt.Errorf("fenced: term %d out of range", term)
	}
	op := Op{Kind: Write, Resource: resource, Client: writer, Term: term, Value: value}
	i, err := r.begin(&op)
	if err != nil {
		return false, err
	}
	// ON CONFLICT DO UPDATE locks the row and judges the WHERE on its
	// latest version: concurrent writes are applied one at a time.
	err = db.QueryRow(ctx, `INSERT INTO `+r.table+` AS f (resource, term, writer, value)
		VALUES ($1, $2, $3, $4)
		ON CONFLICT (resource) DO UPDATE
			SET term = excluded.term, writer = excluded.writer, value = excluded.value
			WHERE f.term <= excluded.term
		RETURNING true`, resource, int64(term), writer, value).Scan(&accepted)
	if errors.Is(err, pgx.ErrNoRows) {
		accepted, err = false, nil // a greater term was seen: refused
	}
	op.Accepted = accepted
	if rerr := r.end(i, op, err); rerr != nil && err == nil {
		err = rerr
	}
	if err != nil {
		return false, fmt.Errorf("fenced: write %q term %d: %w", resource, term, err)
	}
	return accepted, nil
}

// Read returns resource's greatest term and its value: (0, "") if it was
// never written. reader names the client in the history.
func (r *Register) Read(ctx context.Context, db DB, resource, reader string) (term uint64, value string, err error) {
	op := Op{Kind: Read, Resource: resource, Client: reader}
	i, err := r.begin(&op)
	if err != nil {
		return 0, "", err
	}
	var t int64
	err = db.QueryRow(ctx, `SELECT term, value FROM `+r.table+` WHERE resource = $1`, resource).Scan(&t, &value)
	if errors.Is(err, pgx.ErrNoRows) {
		t, value, err = 0, "", nil
	}
	op.Term, op.Value = uint64(t), value
	if rerr := r.end(i, op, err); rerr != nil && err == nil {
		err = rerr
	}
	if err != nil {
		return 0, "", fmt.Errorf("fenced: read %q: %w", resource, err)
	}
	return uint64(t), value, nil
}

// LoadOps reads the operations of every log LogTo wrote in dir. An
// operation whose return line is missing (its process died) is Unknown. A
// last line without its newline is ignored.
func LoadOps(dir string) ([]Op, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("fenced: %w", err)
	}
	var (
		ops   []Op
		index = make(map[string]int)
	)
	for _, ent := range entries {
		if ent.IsDir() || !strings.HasSuffix(ent.Name(), fileSuffix) {
			continue
		}
		path := filepath.Join(dir, ent.Name())
		b, err := os.ReadFile(path)
		if err != nil {
			return nil, fmt.Errorf("fenced: %w", err)
		}
		if i := bytes.LastIndexByte(b, '\n'); i < len(b)-1 {
			b = b[:i+1]
		}
		sc := bufio.NewScanner(bytes.NewReader(b))
		sc.Buffer(nil, 1<<20)
		for line := 1; sc.Scan(); line++ {
			var op Op
			if err := json.Unmarshal(sc.Bytes(), &op); err != nil {
				return nil, fmt.Errorf("fenced: %s:%d: %w", path, line, err)
			}
			if i, ok := index[op.ID]; ok {
				ops[i] = op // the return line replaces the invocation's
			} else {
				index[op.ID] = len(ops)
				ops = append(ops, op)
			}
		}
		if err := sc.Err(); err != nil {
			return nil, fmt.Errorf("fenced: %s: %w", path, err)
		}
	}
	slices.SortStableFunc(ops, func(a, b Op) int {
		switch {
		case a.Invoke < b.Invoke:
			return -1
		case a.Invoke > b.Invoke:
			return 1
		}
		return 0
	})
	return ops, nil
}
