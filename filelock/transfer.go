package filelock

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"slices"
	"time"

	"github.com/leaderelect/leader"
)

// Transfers (leader.Transferer): the pending request and the reservation
// live in the name's state file, the enlisted candidates in its candidates
// file; both are read and written under the state lock, as the lease is.
// See Transfers in the package doc.

var _ leader.Transferer = (*Store)(nil)

// candidatesVersion is the format of the candidates files this package
// writes. A file of a later version is refused rather than misread.
const candidatesVersion = 1

// candidatesFile is the content of a name's candidates file: the
// candidates enlisted for it, each until the end of its period. It is
// replaced whole, like the state, but not synced: it is soft state, which
// the candidates restore by enlisting again every TTL, so a file that a
// crash left torn reads as empty.
type candidatesFile struct {
	Version    int        `json:"version"`
	Name       string     `json:"name"`
	Candidates []enlisted `json:"candidates"`
}

// enlisted is one entry of a candidates file.
type enlisted struct {
	ID       string `json:"id"`
	Token    string `json:"token"`
	Priority int    `json:"priority,omitempty"`
	period
}

// RequestTransfer implements leader.Transferer. The request is kept in the
// state file, with the lease; a grant or a release ends it. The holder
// learns of it at its next renewal, so RequestTransfer wakes nobody.
func (s *Store) RequestTransfer(ctx context.Context, name string, req leader.TransferRequest, ttl time.Duration) (leader.Lease, error) {
	const op = "request transfer"
	if ttl < 0 {
		return leader.Lease{}, s.errorf(op, name, fmt.Errorf("ttl %v is negative", ttl))
	}
	return s.judge(ctx, op, name, func(e *entry, st *state, now reading, held bool) (leader.Lease, error) {
		if !held {
			return st.report(false, s.boot, now), leader.ErrNoLeader
		}
		st.Request = nil
		if ttl > 0 {
			st.Request = &transferRequest{To: req.To, Reason: req.Reason, period: newPeriod(s.boot, now, ttl)}
		}
		// The holder's fields are copied as it wrote them: held found
		// its leader lock taken if it recorded holding it, so the copy
		// is true.
		if err := writeState(e.base+stateSuffix, *st, false); err != nil {
			return leader.Lease{}, writeError(err)
		}
		return st.report(true, s.boot, now), nil
	})
}

// ReleaseTo implements leader.Transferer: a release (see Release) that
// leaves the state reserved for successor until hold has passed. The
// release wakes watchers as a plain one does, so the successor takes the
// lease at once.
func (s *Store) ReleaseTo(ctx context.Context, name, token string, term uint64, successor leader.Candidate, reason leader.GrantReason, hold time.Duration) error {
	switch {
	case successor.Token == "":
		return s.errorf("release", name, errors.New("successor token is empty"))
	case hold <= 0:
		return s.errorf("release", name, fmt.Errorf("hold %v is not positive", hold))
	}
	return s.release(ctx, name, token, term, &handover{to: successor, reason: reason, hold: hold})
}

// Enlist implements leader.Transferer. Entries are kept in the name's
// candidates file, which no watcher looks at.
func (s *Store) Enlist(ctx context.Context, name string, c leader.Candidate, ttl time.Duration) error {
	const op = "enlist"
	switch {
	case c.Token == "":
		return s.errorf(op, name, errors.New("candidate token is empty"))
	case ttl <= 0:
		return s.errorf(op, name, fmt.Errorf("ttl %v is not positive", ttl))
	}
	return s.editCandidates(ctx, op, name, s.enlist(c, ttl))
}

// enlist returns the edit of a candidates file that enlists c until ttl
// has passed, replacing its entry if it has one.
func (s *Store) enlist(c leader.Candidate, ttl time.Duration) func(cf *candidatesFile, now reading) bool {
	return func(cf *candidatesFile, now reading) bool {
		cf.Candidates = slices.DeleteFunc(cf.Candidates, func(x enlisted) bool { return x.Token == c.Token })
		cf.Candidates = append(cf.Candidates, enlisted{ID: c.ID, Token: c.Token, Priority: c.Priority, period: newPeriod(s.boot, now, ttl)})
		return true
	}
}

// Withdraw implements leader.Transferer.
func (s *Store) Withdraw(ctx context.Context, name, token string) error {
	return s.editCandidates(ctx, "withdraw", name, func(cf *candidatesFile, _ reading) bool {
		n := len(cf.Candidates)
		cf.Candidates = slices.DeleteFunc(cf.Candidates, func(x enlisted) bool { return x.Token == token })
		return len(cf.Candidates) != n
	})
}

// Candidates implements leader.Transferer.
func (s *Store) Candidates(ctx context.Context, name string) ([]leader.Candidate, error) {
	const op = "candidates"
	e, stateLock, err := s.begin(ctx, op, name)
	if err != nil {
		return nil, err
	}
	defer s.end(e, stateLock)

	cf, _, err := s.loadCandidates(e)
	if err != nil {
		return nil, s.errorf(op, name, err)
	}
	var out []leader.Candidate
	for _, x := range cf.Candidates {
		out = append(out, leader.Candidate{ID: x.ID, Token: x.Token, Priority: x.Priority})
	}
	return out, nil
}

// editCandidates changes the candidates file of name by edit, under the
// state lock, and writes it if edit or the pruning of lapsed entries
// changed it.
func (s *Store) editCandidates(ctx context.Context, op, name string, edit func(cf *candidatesFile, now reading) bool) error {
	e, stateLock, err := s.begin(ctx, op, name)
	if err != nil {
		return err
	}
	defer s.end(e, stateLock)
	return s.editCandidatesLocked(e, op, name, edit)
}

// editCandidatesLocked is editCandidates for a caller that holds the
// state lock of e.
func (s *Store) editCandidatesLocked(e *entry, op, name string, edit func(cf *candidatesFile, now reading) bool) error {
	cf, now, err := s.loadCandidates(e)
	if err != nil {
		return s.errorf(op, name, err)
	}
	if !edit(&cf.candidatesFile, now) && !cf.pruned {
		return nil
	}
	err = replaceFile(e.base+candidatesSuffix, e.base+candidatesTempSuffix, cf.candidatesFile, false)
	if err != nil {
		return s.errorf(op, name, writeError(err))
	}
	return nil
}

// loadedCandidates is a candidates file as loadCandidates read it.
type loadedCandidates struct {
	candidatesFile
	pruned bool // lapsed entries were left out, or the file was torn
}

// loadCandidates reads the name's candidates file, leaving out the
// entries that have lapsed, and the clocks. The caller holds the state
// lock.
func (s *Store) loadCandidates(e *entry) (loadedCandidates, reading, error) {
	cf, err := readCandidates(e.base+candidatesSuffix, e.name)
	if err != nil {
		return loadedCandidates{}, reading{}, err
	}
	now, err := readNow()
	if err != nil {
		return loadedCandidates{}, reading{}, err
	}
	n := len(cf.Candidates)
	cf.Candidates = slices.DeleteFunc(cf.Candidates, func(x enlisted) bool { return x.left(s.boot, now) == 0 })
	cf.pruned = cf.pruned || len(cf.Candidates) != n
	return cf, now, nil
}

// readCandidates reads the candidates file of name at path. A missing file
// lists nobody, and so does a torn one (pruned then, so that the next edit
// replaces it).
func readCandidates(path, name string) (loadedCandidates, error) {
	empty := candidatesFile{Version: candidatesVersion, Name: name}
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return loadedCandidates{candidatesFile: empty}, nil
	}
	if err != nil {
		return loadedCandidates{}, err
	}
	var cf candidatesFile
	if err := json.Unmarshal(b, &cf); err != nil {
		return loadedCandidates{candidatesFile: empty, pruned: true}, nil
	}
	if cf.Version > candidatesVersion {
		return loadedCandidates{}, fmt.Errorf("candidates file %s has format version %d; this build reads up to %d", path, cf.Version, candidatesVersion)
	}
	if cf.Name != name {
		return loadedCandidates{}, fmt.Errorf("candidates file %s is for name %q, not %q", path, cf.Name, name)
	}
	cf.Version = candidatesVersion
	return loadedCandidates{candidatesFile: cf}, nil
}
