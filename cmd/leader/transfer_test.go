//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/leaderelect/leader"
)

// transferTTL is the TTL of the transfer tests' candidates: a leader acts
// on a request at its next renewal (TTL/3), and yields to a higher
// priority after a TTL.
const transferTTL = 2 * time.Second

// handoverGap bounds, generously for a loaded machine, the time from the
// old leader's child logging its stop to the successor's child logging
// its start in a handover: the old command is already gone then, and what
// remains is the release, the wake-up, one grant and starting a shell.
const handoverGap = 2 * time.Second

// transferStores are the stores the transfer tests run on: the embedded
// store, both PostgreSQL strategies, and etcd (one member process).
var transferStores = []string{"file", "lease", "advisory", "etcd"}

// storeFlags returns the flags naming a fresh store of kind for e: a
// database of its own on PostgreSQL.
func storeFlags(t *testing.T, e *env, kind string) []string {
	t.Helper()
	switch kind {
	case "file":
		return []string{"--store", e.fileStore()}
	case "lease", "advisory":
		return []string{"--store", migrated(t, e), "--strategy", kind}
	case "etcd":
		store, _ := etcdStoreURL(t, 1)
		return []string{"--store", store}
	}
	t.Fatalf("unknown store kind %q", kind)
	return nil
}

// startWith starts a "leader run" instance id with flags, running the child
// script, which logs to log.
func (e *env) startWith(log childLog, id string, flags ...string) *proc {
	e.t.Helper()
	script := filepath.Join(e.dir, "child.sh")
	if _, err := os.Stat(script); err != nil {
		if err := os.WriteFile(script, []byte(childScript), 0o755); err != nil {
			e.t.Fatal(err)
		}
	}
	args := append([]string{"run", "--name", "e2e", "--id", id, "--ttl", transferTTL.String()}, flags...)
	args = append(args, "--", "sh", script)
	return e.with("CHILD_LOG=" + log.path).start(args...)
}

// leaderStart waits for the n-th start in log (from 1) and returns it.
func leaderStart(t *testing.T, log childLog, n int, within time.Duration) childEvent {
	t.Helper()
	waitFor(t, within, fmt.Sprintf("start number %d of a child\nlog:\n%s", n, log), func() bool { return len(log.starts()) >= n })
	return log.starts()[n-1]
}

// startID and startTerm read LEADER_ID and LEADER_TERM off a start event.
func startID(ev childEvent) string { return ev.fields[3] }

func startTerm(t *testing.T, ev childEvent) uint64 {
	t.Helper()
	term, err := strconv.ParseUint(ev.fields[4], 10, 64)
	if err != nil {
		t.Fatalf("start line %v: LEADER_TERM: %v", ev.fields, err)
	}
	return term
}

// stopOf returns the stop event of the child that ev started.
func stopOf(log childLog, ev childEvent) (childEvent, bool) {
	for _, s := range log.events() {
		if s.kind == "stop" && s.pid == ev.pid {
			return s, true
		}
	}
	return childEvent{}, false
}

// enlisted waits until the store that flags name lists every one of ids
// among the candidates of the election e2e. An instance's first attempt
// enlists it, which on a loaded machine may come well after it logs that
// it campaigns (an advisory session's opening took close to a second):
// a wait of 200 ms after that line once had a leader hand over to a
// lower priority, the higher one not yet enlisted.
func enlisted(t *testing.T, flags []string, ids ...string) {
	t.Helper()
	var url, strategy string
	for i := 0; i+1 < len(flags); i++ {
		switch flags[i] {
		case "--store":
			url = flags[i+1]
		case "--strategy":
			strategy = flags[i+1]
		}
	}
	spec, err := parseStoreURL(url)
	if err == nil {
		spec, err = withStrategy(spec, strategy)
	}
	if err != nil {
		t.Fatal(err)
	}
	st, err := openStore(t.Context(), spec, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	ts, ok := st.Store.(leader.Transferer)
	if !ok {
		t.Fatalf("the store %T cannot list candidates", st.Store)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		cands, err := ts.Candidates(ctx, "e2e")
		cancel()
		missing := slices.DeleteFunc(slices.Clone(ids), func(id string) bool {
			return slices.ContainsFunc(cands, func(c leader.Candidate) bool { return c.ID == id })
		})
		switch {
		case err == nil && len(missing) == 0:
			return
		case time.Now().After(deadline):
			t.Fatalf("%v not among the candidates after 20 s: the store lists %v (%v)", missing, cands, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func statusJSONOf(t *testing.T, e *env, store []string) statusJSON {
	t.Helper()
	out, stderr, code := e.run(append([]string{"status", "--name", "e2e", "--json"}, store...)...)
	if code != 0 {
		t.Fatalf("status: exit %d\n%s", code, stderr)
	}
	var st statusJSON
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatalf("status --json: %v\n%s", err, out)
	}
	return st
}

func TestTransferCommand(t *testing.T) {
	t.Parallel()
	for _, kind := range transferStores {
		t.Run(kind+": transfer hands over to the named instance, which starts at once with the next term", func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			store := storeFlags(t, e, kind)
			log := newChildLog(t, e)
			ps := map[string]*proc{}
			for _, id := range []string{"a", "b", "c"} {
				ps[id] = e.startWith(log, id, store...)
			}
			first := leaderStart(t, log, 1, 20*time.Second)
			var followers []string
			for id := range ps {
				if id != startID(first) {
					followers = append(followers, id)
				}
			}
			enlisted(t, store, followers...)
			to := map[string]string{"a": "b", "b": "c", "c": "a"}[startID(first)]

			if _, stderr, code := e.run(append([]string{"transfer", "--name", "e2e", "--to", "nobody"}, store...)...); code != exitFailure || !strings.Contains(stderr, `"nobody"`) {
				t.Errorf("transfer to an instance that does not campaign: exit %d, want %d naming it\n%s", code, exitFailure, stderr)
			}
			out, stderr, code := e.run(append([]string{"transfer", "--name", "e2e", "--to", to}, store...)...)
			if code != 0 || !strings.Contains(out, "over to "+to) {
				t.Fatalf("transfer --to %s: exit %d\n%s%s", to, code, out, stderr)
			}
			next := leaderStart(t, log, 2, 10*time.Second)
			if startID(next) != to || startTerm(t, next) != startTerm(t, first)+1 {
				t.Errorf("after the transfer, %s started with term %d; want %s with term %d\nlog:\n%s", startID(next), startTerm(t, next), to, startTerm(t, first)+1, log)
			}
			if stop, ok := stopOf(log, first); !ok || next.at.Sub(stop.at) > handoverGap {
				t.Errorf("the successor started %v after the old command stopped; want at most %v\nlog:\n%s", next.at.Sub(stop.at), handoverGap, log)
			}
			if st := statusJSONOf(t, e, store); st.Reason != "transfer" || st.Leader == nil || *st.Leader != to {
				t.Errorf("status after the transfer: %+v; want %s leading, reason transfer", st, to)
			}
			log.assertAtMostOneRunsFor(time.Second)
			log.checkNoOverlap()
			if n := len(log.starts()); n != 2 {
				t.Errorf("%d starts; want 2\nlog:\n%s", n, log)
			}
		})

		t.Run(kind+": SIGTERM to the leader hands over to the highest priority", func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			store := storeFlags(t, e, kind)
			log := newChildLog(t, e)
			a := e.startWith(log, "a", append(store, "--priority", "9")...)
			first := leaderStart(t, log, 1, 20*time.Second)
			if startID(first) != "a" {
				t.Fatalf("%s leads, not a", startID(first))
			}
			e.startWith(log, "b", append(store, "--priority", "3")...)
			e.startWith(log, "c", append(store, "--priority", "5")...)
			enlisted(t, store, "b", "c")
			a.signal(syscall.SIGTERM)
			if code := a.wait(20 * time.Second); code != 0 {
				t.Errorf("the leader exited %d after SIGTERM; want 0\n%s", code, a.stderr.String())
			}
			next := leaderStart(t, log, 2, 10*time.Second)
			if startID(next) != "c" || startTerm(t, next) != startTerm(t, first)+1 {
				t.Errorf("after SIGTERM, %s started with term %d; want c (priority 5, above b's 3) with term %d\nlog:\n%s", startID(next), startTerm(t, next), startTerm(t, first)+1, log)
			}
			if !strings.Contains(a.stderr.String(), "handed over") {
				t.Errorf("the leader's log does not say it handed over:\n%s", a.stderr.String())
			}
			if st := statusJSONOf(t, e, store); st.Reason != "transfer" {
				t.Errorf("status after the SIGTERM handover: reason %q; want transfer", st.Reason)
			}
			log.checkNoOverlap()
		})
	}
}

// TestRollingDeploy replaces each of 5 instances in turn, the new one
// (a higher --priority) started before the old one gets SIGTERM: the
// leader changes once, to a new instance, and no moment passes without a
// leader beyond the handover gap.
func TestRollingDeploy(t *testing.T) {
	t.Parallel()
	for _, kind := range transferStores {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			store := storeFlags(t, e, kind)
			log := newChildLog(t, e)
			old := make([]*proc, 5)
			for i := range old {
				old[i] = e.startWith(log, fmt.Sprint("old", i), append(store, "--priority", "1")...)
			}
			leaderStart(t, log, 1, 20*time.Second)
			for i := range old {
				e.startWith(log, fmt.Sprint("new", i), append(store, "--priority", "2")...)
				enlisted(t, store, fmt.Sprint("new", i))
				old[i].signal(syscall.SIGTERM)
				if code := old[i].wait(20 * time.Second); code != 0 {
					t.Fatalf("old%d exited %d after SIGTERM\n%s", i, code, old[i].stderr.String())
				}
			}
			// The last old instance to lead hands over as it stops (its
			// process may exit before its successor's command starts);
			// then a TTL passes, in which no further change may come.
			leaderStart(t, log, 2, 10*time.Second)
			time.Sleep(transferTTL)
			starts := log.starts()
			if len(starts) != 2 || !strings.HasPrefix(startID(starts[1]), "new") {
				t.Fatalf("the leader changed %d times; want once, to a new instance\nlog:\n%s", len(starts)-1, log)
			}
			stop, ok := stopOf(log, starts[0])
			if !ok {
				t.Fatalf("no stop logged for the first leader\nlog:\n%s", log)
			}
			gap := starts[1].at.Sub(stop.at)
			t.Logf("%s: leadership moved once, from %s to %s, %v after the old command stopped", kind, startID(starts[0]), startID(starts[1]), gap)
			if gap > handoverGap {
				t.Errorf("no leader for %v during the deploy; want at most %v", gap, handoverGap)
			}
			log.checkNoOverlap()
		})
	}
}
