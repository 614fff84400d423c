//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"context"
	"encoding/json"
	"net/url"
	"strings"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

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
	failover(t, e, store, "2s", 20*time.Second)
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

// TestEtcdStoreWithAuthentication runs "leader run" and "leader status"
// on an etcd member with authentication on, with the user and password in
// the store URL (the password escaped, as a URL needs it): they
// authenticate, and a wrong password fails with etcd's refusal, never
// printing the password.
func TestEtcdStoreWithAuthentication(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	c := etcdtest.StartCluster(t, 1)
	admin, err := clientv3.New(clientv3.Config{Endpoints: c.Endpoints(), DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	const password = "pa:ss word!"
	if _, err := admin.RoleAdd(ctx, "root"); err != nil && !strings.Contains(err.Error(), "already exists") {
		t.Fatal(err)
	}
	for _, step := range []func() error{
		func() error { _, err := admin.UserAdd(ctx, "root", password); return err },
		func() error { _, err := admin.UserGrantRole(ctx, "root", "root"); return err },
		func() error { _, err := admin.AuthEnable(ctx); return err },
	} {
		if err := step(); err != nil {
			t.Fatalf("turning authentication on: %v", err)
		}
	}
	host := strings.TrimPrefix(c.Endpoints()[0], "http://")
	store := func(pw string) string {
		return "etcd://" + url.UserPassword("root", pw).String() + "@" + host + "?prefix=auth%2F"
	}

	r := e.start("run", "--store", store(password), "--name", "auth", "--id", "alpha", "--ttl", "2s", "--", "sleep", "1000")
	defer r.signal(syscall.SIGTERM)
	waitFor(t, 20*time.Second, "status to show alpha leading", func() bool {
		out, _, code := e.run("status", "--store", store(password), "--name", "auth", "--json")
		var st map[string]any
		return code == 0 && json.Unmarshal([]byte(out), &st) == nil && st["leader"] == "alpha"
	})

	const wrong = "not-the-password-42"
	out, stderr, code := e.run("status", "--store", store(wrong), "--name", "auth", "--json")
	if code == 0 {
		t.Fatalf("status with a wrong password succeeded: %s", out)
	}
	if !strings.Contains(stderr, "authentication failed") {
		t.Errorf("status with a wrong password did not say that authentication failed:\n%s", stderr)
	}
	if strings.Contains(out+stderr, wrong) || strings.Contains(out+stderr, url.PathEscape(wrong)) {
		t.Errorf("the wrong password was printed:\n%s%s", out, stderr)
	}
}
