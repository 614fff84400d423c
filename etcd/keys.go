package etcd

import (
	"encoding/json"
	"fmt"
	"math"
	"net/url"
	"strconv"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/leaderelect/leader"
)

// keys are the etcd keys of one election name (see "Key layout" in the
// package documentation). The name is path-escaped, so it never contains
// a '/' and one name's keys are never a prefix of another's.
type keys struct {
	prefix  string // the Store's prefix
	esc     string // the escaped name
	names   string // <prefix>names/<esc>/, the prefix that watchers watch
	holder  string // <prefix>names/<esc>/holder: the holder's token, on its lease
	record  string // <prefix>names/<esc>/record: the last grant, never on a lease
	reserve string // <prefix>names/<esc>/reserved: a successor's token, on a lease of the hold
	request string // <prefix>requests/<esc>: a pending request to hand over
	cands   string // <prefix>candidates/<esc>/: the enlisted candidates, by token
}

func (s *Store) keys(name string) keys {
	esc := url.PathEscape(name)
	names := s.prefix + "names/" + esc + "/"
	return keys{
		prefix:  s.prefix,
		esc:     esc,
		names:   names,
		holder:  names + "holder",
		record:  names + "record",
		reserve: names + "reserved",
		request: s.prefix + "requests/" + esc,
		cands:   s.prefix + "candidates/" + esc + "/",
	}
}

// candidate returns the key of token's entry among the name's candidates.
func (k keys) candidate(token string) string { return k.cands + url.PathEscape(token) }

// held returns the key that indexes the name under the holder lease id: a
// round of renewals reads every name a lease holds with one range read.
func (k keys) held(id clientv3.LeaseID) string { return heldPrefix(k.prefix, id) + k.esc }

func heldPrefix(prefix string, id clientv3.LeaseID) string {
	return fmt.Sprintf("%sheld/%016x/", prefix, int64(id))
}

func requestsPrefix(prefix string) string { return prefix + "requests/" }

// record is the value of a name's record key: its last grant, and how that
// grant ended if it has. The record is never on a lease, so the term
// survives every release and expiry (DESIGN.md invariant 2).
type record struct {
	Term     uint64             `json:"term"`
	ID       string             `json:"id"`
	Priority int                `json:"priority,omitempty"`
	Reason   leader.GrantReason `json:"reason,omitempty"`
	// Acquired is the granting client's wall clock at the grant, in Unix
	// nanoseconds: for display only.
	Acquired int64 `json:"acquired"`
	// TTL is the ttl of the holder's last grant or renewal: how long a
	// follower is told the lease may still be held.
	TTL time.Duration `json:"ttl"`
	// Released is set by a release, so that the next grant tells a
	// release (GrantRelease) from an expiry (GrantExpiry).
	Released bool `json:"released,omitempty"`
	// A release by ReleaseTo: whom it reserved the lease for, why, and
	// for how long. The reservation itself is the reserved key.
	SuccessorID     string             `json:"successor_id,omitempty"`
	SuccessorReason leader.GrantReason `json:"successor_reason,omitempty"`
	Hold            time.Duration      `json:"hold,omitempty"`
	// ReservedUntil is the releasing client's wall clock, when it asked
	// for the reservation's lease, plus Hold, in Unix nanoseconds: how
	// long followers are told the reservation remains (a hint; the
	// reserved key decides).
	ReservedUntil int64 `json:"reserved_until,omitempty"`
}

// request is the value of a name's request key.
type request struct {
	To     string             `json:"to,omitempty"`
	Reason leader.GrantReason `json:"reason"`
	// Until is the requester's wall clock plus the request's ttl, in Unix
	// nanoseconds; the key's lease removes it within about twice the ttl,
	// whatever the clocks say.
	Until int64         `json:"until"`
	TTL   time.Duration `json:"ttl"`
}

// candidateEntry is the value of a candidate's key.
type candidateEntry struct {
	ID       string `json:"id"`
	Token    string `json:"token"`
	Priority int    `json:"priority,omitempty"`
}

// heldValue is the value of a held-index key: the term and token of the
// grant it indexes.
func heldValue(term uint64, token string) string {
	return strconv.FormatUint(term, 10) + " " + token
}

func parseHeldValue(v []byte) (uint64, string, bool) {
	t, tok, ok := strings.Cut(string(v), " ")
	if !ok {
		return 0, "", false
	}
	term, err := strconv.ParseUint(t, 10, 64)
	return term, tok, err == nil
}

func mustJSON(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err) // plain structs of strings and numbers
	}
	return string(b)
}

// leaseSeconds is the etcd lease TTL for a leader ttl: rounded up to a
// whole second, so that the etcd lease never ends before the holder's
// local deadline.
func leaseSeconds(ttl time.Duration) int64 {
	secs := int64(math.Ceil(ttl.Seconds()))
	if time.Duration(secs)*time.Second < ttl { // float rounding
		secs++
	}
	return max(secs, 1)
}
