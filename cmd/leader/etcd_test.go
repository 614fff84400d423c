//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"net/url"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/leaderelect/leader/etcd/etcdtest"
)

// etcdStoreURL starts an etcd cluster of n member processes for t and
// returns an etcd:// store URL naming every member, with keys under a
// prefix of the test's own.
func etcdStoreURL(t *testing.T, n int) (string, *etcdtest.Cluster) {
	t.Helper()
	c := etcdtest.StartCluster(t, n)
	var hosts []string
	for _, ep := range c.Endpoints() {
		u, err := url.Parse(ep)
		if err != nil {
			t.Fatal(err)
		}
		hosts = append(hosts, u.Host)
	}
	prefix := strings.NewReplacer("/", "-", " ", "-").Replace(t.Name())
	return "etcd://" + strings.Join(hosts, ",") + "?prefix=" + url.QueryEscape(prefix+"/"), c
}

// TestRunFailoverOnEtcd runs three "leader run" instances on a 3-member
// etcd cluster: SIGKILL of the leading one starts another's command once
// the killed one's etcd lease has run out, with a greater term, and never
// while the killed one's command runs; SIGTERM hands over at once.
func TestRunFailoverOnEtcd(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	store, _ := etcdStoreURL(t, 3)
	// The etcd lease of a 2 s TTL lasts 2 s (etcd's leases are whole
	// seconds), and etcd ends it up to a second later.
	failover(t, e, store, "2s", 20*time.Second, 2*time.Second)
}

// TestRunOnEtcdSurvivesTheLossOfAMember kills the etcd member that is the
// cluster's Raft leader while a "leader run" leads: the store's client
// moves to another member, the commands never overlap, and the terms
// never go back.
func TestRunOnEtcdSurvivesTheLossOfAMember(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	store, c := etcdStoreURL(t, 3)
	log := newChildLog(t, e)
	procs := e.candidates(3, log, store, "--ttl", "2s")
	waitFor(t, 20*time.Second, "the first child to start", func() bool { return len(log.starts()) >= 1 })
	first := log.starts()[0]

	i, err := c.LeaderIndex(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	c.Member(i).Kill()
	// A new etcd leader is elected within a second or two; the leading
	// instance may lose its lease meanwhile (its renewals fail for up to
	// its deadline), and another then takes over: never two at once.
	log.assertAtMostOneRunsFor(6 * time.Second)
	log.checkNoOverlap()
	starts := log.starts()
	last := starts[len(starts)-1]
	if startTerm(t, last) < startTerm(t, first) {
		t.Errorf("the term went back from %d to %d\nlog:\n%s", startTerm(t, first), startTerm(t, last), log)
	}
	waitFor(t, 20*time.Second, "a command running after the member's death", func() bool {
		return len(log.running()) == 1
	})

	// The instances still hand over.
	leaderID := startID(log.starts()[len(log.starts())-1])
	n := len(log.starts())
	procs[leaderID].signal(syscall.SIGTERM)
	waitFor(t, 20*time.Second, "a start after SIGTERM of the leader", func() bool { return len(log.starts()) > n })
	log.checkNoOverlap()
}
