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
)

// Suffixes of the files kept for one name, after its encoded base name.
const (
	leaderLockSuffix = ".leader.lock" // flocked by the holder for its whole tenure
	stateLockSuffix  = ".state.lock"  // flocked around each read-modify-write of the state
	stateSuffix      = ".state"       // the lease, as JSON
	tempSuffix       = ".state.tmp"   // the next state, before it is renamed over the state
)

// stateVersion is the format of the state files this package writes. A state
// file of a later version is refused rather than misread.
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
}

// reading is the store's "now": the monotonic clock that decides expiry
// and the wall clock for display.
type reading struct {
	clock int64
	wall  time.Time
}

// unexpired reports whether st's holder, if any, still has time left at now.
// A state written during another boot has expired: every process that could
// hold it has died since. So has one whose last renewal lies in the future
// of a clock that restarts at boot, for a host without a known boot ID.
func (st *state) unexpired(boot string, now reading) bool {
	if st.BootID != "" && boot != "" && st.BootID != boot {
		return false
	}
	if st.Clock != "" && st.Clock != clockName {
		return false // written by a build judging another clock; cannot compare
	}
	if clockResetsAtBoot && now.clock < st.RenewedClock {
		return false
	}
	return now.clock < st.ExpiresClock
}

// lease reports st as held at now. The caller has decided that it is held.
func (st *state) lease(now reading) leader.Lease {
	remaining := time.Duration(st.ExpiresClock - now.clock)
	return leader.Lease{
		Name:       st.Name,
		HolderID:   st.HolderID,
		Term:       st.Term,
		AcquiredAt: st.AcquiredAt,
		ExpiresAt:  now.wall.Add(remaining),
		Remaining:  remaining,
	}
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
	b, err := json.MarshalIndent(st, "", "  ")
	if err != nil {
		return err
	}
	b = append(b, '\n')
	tmp := strings.TrimSuffix(path, stateSuffix) + tempSuffix
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	_, err = f.Write(b)
	if err == nil {
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
		return err
	}
	if durable {
		return syncDir(filepath.Dir(path))
	}
	return nil
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
