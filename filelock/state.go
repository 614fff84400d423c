package filelock

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/wallclock"
)

// Suffixes of the files kept for one name, after its encoded base name.
const (
	leaderLockSuffix = ".leader.lock" // flocked by the holder for its whole tenure
	stateLockSuffix  = ".state.lock"  // flocked around each read-modify-write of the state
	stateSuffix      = ".state"       // the lease, as JSON
	tempSuffix       = ".state.tmp"   // the next state, before it is renamed over the state

	candidatesSuffix     = ".candidates"     // the enlisted candidates, as JSON
	candidatesTempSuffix = ".candidates.tmp" // the next candidates, before the rename
)

// stateVersion is the format of the state files this package writes. A state
// file of a later version is refused rather than misread. The fields that
// transfers added (priority, reason, transfer_request, reserved) kept it at
// 1: readers that predate them ignore them, and an older binary still
// running on the host must go on reading the state (see Transfers in the
// package doc for what it makes of them).
const stateVersion = 1

// Limits of encoded names, so that every file name stays well under the 255
// bytes most file systems allow.
const (
	maxEncodedLen = 200
	hashPrefixLen = 150
)

// encodeName maps an election name to the base of its file names. Bytes
// a-z, 0-9, '-' and '_' stand for themselves; every other byte, including
// upper-case letters (some file systems ignore case) and '.', becomes %XX
// with upper-case hex digits, so the encoding is reversible, contains no
// '/', and the first '.' of a file name ends its encoded name. An encoding
// longer than maxEncodedLen bytes, and the empty name's, is cut to at most
// hashPrefixLen bytes and followed by '~' and 32 hex digits of the name's
// SHA-256; '~' appears nowhere else, so the two forms never collide.
func encodeName(name string) string {
	var b strings.Builder
	for i := 0; i < len(name); i++ {
		c := name[i]
		if 'a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '-' || c == '_' {
			b.WriteByte(c)
		} else {
			fmt.Fprintf(&b, "%%%02X", c)
		}
	}
	enc := b.String()
	if enc != "" && len(enc) <= maxEncodedLen {
		return enc
	}
	cut := min(len(enc), hashPrefixLen)
	if i := strings.LastIndexByte(enc[:cut], '%'); i >= 0 && i+3 > cut {
		cut = i // do not split an escape
	}
	sum := sha256.Sum256([]byte(name))
	return enc[:cut] + "~" + hex.EncodeToString(sum[:16])
}

// state is the content of a name's state file. It is only ever replaced
// whole (written to the temporary file, synced, renamed over the state file)
// by a process holding the name's state lock, so readers never see half of
// one.
type state struct {
	Version int    `json:"version"`
	Name    string `json:"name"`
	// Term is the fencing term of the current or last grant. It is kept
	// when the lease is released or expires.
	Term uint64 `json:"term"`

	// The holder; all empty or zero when the lease is free.
	HolderID string `json:"holder_id,omitempty"`
	Token    string `json:"token,omitempty"`
	PID      int    `json:"pid,omitempty"`
	// LeaderLock reports that the holder's process held the name's leader
	// lock when it last wrote the state, and keeps holding it while it holds
	// the lease. Then, if the leader lock can be taken, the holder is gone
	// (exited or killed) and the lease is free whatever its expiry says.
	LeaderLock bool `json:"leader_lock,omitempty"`

	// Wall-clock times, for people and for Lease.AcquiredAt.
	AcquiredAt time.Time `json:"acquired_at,omitzero"`
	RenewedAt  time.Time `json:"renewed_at,omitzero"`
	ExpiresAt  time.Time `json:"expires_at,omitzero"`

	// Expiry is judged on these: readings of Clock (CLOCK_MONOTONIC on
	// Linux) at the last grant or renewal and at the expiry, taken during
	// the boot BootID.
	Clock        string `json:"clock,omitempty"`
	BootID       string `json:"boot_id,omitempty"`
	RenewedClock int64  `json:"renewed_clock_ns,omitempty"`
	ExpiresClock int64  `json:"expires_clock_ns,omitempty"`

	// Transfers (see leader.Transferer). Priority is the holder's
	// Candidate.Priority, as granted; Reason says why the current (or
	// last) holder was granted the lease, and is kept by a release.
	Priority int                `json:"priority,omitempty"`
	Reason   leader.GrantReason `json:"reason,omitempty"`
	// Request is the holder's pending request to hand over, if any; a
	// grant or a release ends it.
	Request *transferRequest `json:"transfer_request,omitempty"`
	// Reserved is, in a released state (no Token), the successor that
	// ReleaseTo reserved the lease for.
	Reserved *reservation `json:"reserved,omitempty"`
}

// period is a span of time on the store's clock, as the files record it:
// it began at the reading FromClock of Clock, taken during the boot BootID,
// and ends at the reading UntilClock. Until is its end on the wall clock,
// for people.
type period struct {
	Clock      string    `json:"clock,omitempty"`
	BootID     string    `json:"boot_id,omitempty"`
	FromClock  int64     `json:"from_clock_ns,omitempty"`
	UntilClock int64     `json:"until_clock_ns"`
	Until      time.Time `json:"until,omitzero"`
}

// transferRequest is a pending request that the holder hand over
// (RequestTransfer), until the end of its period.
type transferRequest struct {
	To     string             `json:"to,omitempty"`
	Reason leader.GrantReason `json:"reason"`
	period
}

// reservation is a released lease's reservation for the successor whose
// token is Token (ReleaseTo), until the end of its period: only the
// successor is granted the lease meanwhile, and its grant's reason is
// Reason.
type reservation struct {
	ID     string             `json:"id"`
	Token  string             `json:"token"`
	Reason leader.GrantReason `json:"reason"`
	period
}

// reading is the store's "now": the monotonic clock that decides expiry
// and the wall clock for display.
type reading struct {
	clock int64
	wall  time.Time
}

// readNow reads the store's "now".
func readNow() (reading, error) {
	clock, err := monotonicNow()
	if err != nil {
		return reading{}, err
	}
	return reading{clock: clock, wall: wallclock.Now()}, nil
}

// newPeriod returns the period of d from now, during boot.
func newPeriod(boot string, now reading, d time.Duration) period {
	return period{
		Clock:      clockName,
		BootID:     boot,
		FromClock:  now.clock,
		UntilClock: now.clock + int64(d),
		Until:      now.wall.Add(d),
	}
}

// left returns how long p has left at now, during boot, or zero. A period
// recorded during another boot has ended: every process that recorded it
// has died since. So has one that begins in the future of a clock that
// restarts at boot, for a host without a known boot ID.
func (p period) left(boot string, now reading) time.Duration {
	if p.BootID != "" && boot != "" && p.BootID != boot {
		return 0
	}
	if p.Clock != "" && p.Clock != clockName {
		return 0 // written by a build judging another clock; cannot compare
	}
	if clockResetsAtBoot && now.clock < p.FromClock {
		return 0
	}
	return max(0, time.Duration(p.UntilClock-now.clock))
}

// unexpired reports whether st's holder, if any, still has time left at now
// (see period.left): from its last renewal to its expiry.
func (st *state) unexpired(boot string, now reading) bool {
	p := period{Clock: st.Clock, BootID: st.BootID, FromClock: st.RenewedClock, UntilClock: st.ExpiresClock}
	return p.left(boot, now) > 0
}

// reservation returns the reservation of a released st that has time left
// at now, or nil.
func (st *state) reservation(boot string, now reading) *reservation {
	if st.Token != "" || st.Reserved == nil || st.Reserved.left(boot, now) == 0 {
		return nil
	}
	return st.Reserved
}

// grantReason says why a grant over st is made: held tells whether st is
// held (by the grantee: a grant to itself), and r is the reservation for
// the grantee, if any. A released state names no holder; one that does,
// but is not held, expired or lost its holder.
func (st *state) grantReason(held bool, r *reservation) leader.GrantReason {
	switch {
	case held || st.Term == 0:
		return leader.GrantFirst
	case r != nil:
		return r.Reason
	case st.Token == "":
		return leader.GrantRelease
	}
	return leader.GrantExpiry
}

// report is how the Store reports st at now, during boot: held (as the
// caller judged it) by its holder, with the pending request; or free,
// with the reservation.
func (st *state) report(held bool, boot string, now reading) leader.Lease {
	if !held {
		l := leader.Lease{Name: st.Name, Term: st.Term, Reason: st.Reason}
		if r := st.reservation(boot, now); r != nil {
			l.Successor, l.Reserved = r.ID, r.left(boot, now)
		}
		return l
	}
	remaining := time.Duration(st.ExpiresClock - now.clock)
	l := leader.Lease{
		Name:       st.Name,
		HolderID:   st.HolderID,
		Term:       st.Term,
		AcquiredAt: st.AcquiredAt,
		ExpiresAt:  now.wall.Add(remaining),
		Remaining:  remaining,
		Priority:   st.Priority,
		Reason:     st.Reason,
	}
	if r := st.Request; r != nil {
		if left := r.left(boot, now); left > 0 {
			l.Transfer = leader.TransferRequest{To: r.To, Reason: r.Reason, Remaining: left}
		}
	}
	return l
}

// readState reads the state file of name at path. A missing file is a name
// never granted.
func readState(path, name string) (state, error) {
	st, err := parseState(path)
	if errors.Is(err, fs.ErrNotExist) {
		return state{Version: stateVersion, Name: name}, nil
	}
	if err != nil {
		return state{}, err
	}
	if st.Name != name {
		return state{}, fmt.Errorf("state file %s is for name %q, not %q", path, st.Name, name)
	}
	return st, nil
}

// parseState reads the state file at path.
func parseState(path string) (state, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return state{}, err
	}
	var st state
	if err := json.Unmarshal(b, &st); err != nil {
		return state{}, fmt.Errorf("corrupt state file %s (remove it to start the name afresh, losing its term): %w", path, err)
	}
	if st.Version > stateVersion {
		return state{}, fmt.Errorf("state file %s has format version %d; this build reads up to %d", path, st.Version, stateVersion)
	}
	return st, nil
}

// writeState replaces the state file at path with st: it writes a temporary
// file, syncs it, and renames it over path, so that a crash at any point
// leaves either the old state or the new one, never a torn or empty file.
// With durable, it also syncs the directory, so that the rename itself
// survives a power loss; grants need that, because they raise the term and
// a term must never go back.
func writeState(path string, st state, durable bool) error {
	tmp := strings.TrimSuffix(path, stateSuffix) + tempSuffix
	if err := replaceFile(path, tmp, st, true); err != nil {
		return err
	}
	if durable {
		return syncDir(filepath.Dir(path))
	}
	return nil
}

// replaceFile replaces the file at path with v as JSON, written to tmp and
// renamed over path, so that readers see the old content or the new one,
// never a torn file. With sync, it syncs tmp before the rename, so that a
// crash cannot leave path torn or empty either.
func replaceFile(path, tmp string, v any, sync bool) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	b = append(b, '\n')
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	_, err = f.Write(b)
	if err == nil && sync {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		_ = os.Remove(tmp)
	}
	return err
}

// syncDir makes the renames in dir durable. Some file systems cannot sync a
// directory (EINVAL, ENOTSUP); there the rename is as durable as they make
// it.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	err = d.Sync()
	if cannotSyncDir(err) {
		err = nil
	}
	if cerr := d.Close(); err == nil {
		err = cerr
	}
	return err
}
