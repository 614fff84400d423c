package etcd_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/etcd"
)

const waitTimeout = 10 * time.Second

func newCandidate(id string) leader.Candidate {
	return leader.Candidate{ID: id, Token: randomHex(16)}
}

func callCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), waitTimeout)
	t.Cleanup(cancel)
	return ctx
}

func mustGrant(t *testing.T, s leader.Store, name string, c leader.Candidate, ttl time.Duration) leader.Lease {
	t.Helper()
	l, granted, err := s.Acquire(callCtx(t), name, c, ttl)
	if err != nil || !granted {
		t.Fatalf("Acquire(%q, %s): granted %v, %v: %+v", name, c.ID, granted, err, l)
	}
	return l
}

// holderLease returns the etcd lease that name's holder key is on.
func holderLease(t *testing.T, cli *clientv3.Client, prefix, name string) clientv3.LeaseID {
	t.Helper()
	resp, err := cli.Get(callCtx(t), prefix+"names/"+name+"/holder")
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("holder key of %s: %v, %v", name, err, resp)
	}
	return clientv3.LeaseID(resp.Kvs[0].Lease)
}

// holderLeases returns the etcd leases that the holder keys under prefix
// are on, with how many keys each holds.
func holderLeases(t *testing.T, cli *clientv3.Client, prefix string) map[clientv3.LeaseID]int {
	t.Helper()
	resp, err := cli.Get(callCtx(t), prefix+"names/", clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	out := make(map[clientv3.LeaseID]int)
	for _, kv := range resp.Kvs {
		if strings.HasSuffix(string(kv.Key), "/holder") {
			out[clientv3.LeaseID(kv.Lease)]++
		}
	}
	return out
}

// Not parallel: it loads etcd with 10,000 grants, alone, before the
// parallel tests run.
func TestManyNamesShareOneLeaseAndOneKeepAlivePerRound(t *testing.T) {
	const (
		names = 10000
		// Far longer than the grants take on a slow machine, so that no
		// name reaches its deadline before the renewals.
		ttl = 2 * time.Minute
	)
	var n counts
	cli := newClient(t, &n)
	s := newStore(t, cli)
	alice := newCandidate("alice")
	batch := make([]leader.Renewal, names)
	work := make(chan int)
	var wg sync.WaitGroup
	for range 64 {
		wg.Go(func() {
			for i := range work {
				name := fmt.Sprintf("job-%05d", i)
				l, granted, err := s.Acquire(t.Context(), name, alice, ttl)
				if err != nil || !granted {
					t.Errorf("Acquire(%s): granted %v, %v", name, granted, err)
					continue
				}
				batch[i] = leader.Renewal{Name: name, Token: alice.Token, Term: l.Term, TTL: ttl}
			}
		})
	}
	start := time.Now()
	for i := range names {
		work <- i
	}
	close(work)
	wg.Wait()
	if t.Failed() {
		return
	}
	t.Logf("%d grants in %v", names, time.Since(start))
	if leases := holderLeases(t, cli, s.Prefix()); len(leases) != 1 {
		t.Fatalf("%d names held with one ttl are on %d etcd leases; want one: %v", names, len(leases), leases)
	}

	for round := 1; round <= 3; round++ {
		ka, txns, unary := n.keepAlives.Load(), n.txns.Load(), n.unary.Load()
		start := time.Now()
		s.RenewBatch(callCtx(t), batch)
		took := time.Since(start)
		for _, r := range batch {
			if r.Err != nil || r.Lease.Term != r.Term || !r.Lease.Held() {
				t.Fatalf("round %d: renewal of %s: %v, %+v", round, r.Name, r.Err, r.Lease)
			}
		}
		ka, txns, unary = n.keepAlives.Load()-ka, n.txns.Load()-txns, n.unary.Load()-unary
		t.Logf("round %d: %d names renewed in %v with %d keep-alive and %d other requests", round, names, took, ka, unary)
		if ka != 1 || txns != 1 || unary != 1 {
			t.Fatalf("round %d of %d renewals sent %d keep-alives and %d requests (%d transactions); want one of each", round, names, ka, unary, txns)
		}
	}
}

func TestATTLIsRoundedUpToWholeSecondsOfEtcdLease(t *testing.T) {
	t.Parallel()
	cli := newClient(t, nil)
	s := newStore(t, cli)
	for _, c := range []struct {
		ttl  time.Duration
		secs int64
	}{{300 * time.Millisecond, 1}, {1000 * time.Millisecond, 1}, {1001 * time.Millisecond, 2}, {2500 * time.Millisecond, 3}} {
		name := "job-" + c.ttl.String()
		mustGrant(t, s, name, newCandidate("alice"), c.ttl)
		resp, err := cli.Get(callCtx(t), s.Prefix()+"names/"+name+"/holder")
		if err != nil || len(resp.Kvs) != 1 {
			t.Fatalf("holder key of %s: %v, %v", name, err, resp)
		}
		ttl, err := cli.TimeToLive(callCtx(t), clientv3.LeaseID(resp.Kvs[0].Lease))
		if err != nil {
			t.Fatal(err)
		}
		if ttl.GrantedTTL != c.secs {
			t.Errorf("a name held for %v is on an etcd lease of %ds; want %ds", c.ttl, ttl.GrantedTTL, c.secs)
		}
	}
}

// A holder whose process dies leaves its key to etcd's lease, which ends
// it within the ttl rounded up to a whole second (and half a second more):
// the free-watchers wake, and the next grant has the next term.
func TestAKilledHolderFreesTheNameWhenItsEtcdLeaseEnds(t *testing.T) {
	t.Parallel()
	const ttl = 800 * time.Millisecond
	prefix := "test-" + randomHex(6) + "/"
	holderClient := newClient(t, nil)
	holder, err := etcd.New(holderClient, etcd.WithPrefix(prefix))
	if err != nil {
		t.Fatal(err)
	}
	follower := newStore(t, newClient(t, nil), etcd.WithPrefix(prefix))
	name := "job"
	alice, bob := newCandidate("alice"), newCandidate("bob")

	sent := time.Now()
	held := mustGrant(t, holder, name, alice, ttl)
	free, err := follower.WatchFree(t.Context(), name)
	if err != nil {
		t.Fatal(err)
	}
	all, err := follower.Watch(t.Context(), name)
	if err != nil {
		t.Fatal(err)
	}
	// The process dies: nothing renews, releases or deletes its key.
	holder.Close()
	holderClient.Close()

	if l, granted, err := follower.Acquire(callCtx(t), name, bob, ttl); err != nil || granted {
		t.Fatalf("bob's Acquire of alice's lease: granted %v, %v: %+v", granted, err, l)
	} else if l.HolderID != alice.ID || l.Remaining <= 0 || l.Remaining > ttl {
		t.Fatalf("bob told %+v; want alice holding, with 0 < Remaining <= %v", l, ttl)
	}
	select {
	case <-free:
	case <-time.After(waitTimeout):
		t.Fatalf("no free-watcher wake-up %v after the holder died", waitTimeout)
	}
	woke := time.Since(sent)
	if woke < ttl {
		t.Fatalf("free-watcher woke %v after the grant of a %v lease was sent: before the holder's deadline", woke, ttl)
	}
	if limit := time.Second + 4*time.Second; woke > limit {
		t.Errorf("free-watcher woke %v after the grant of a %v lease; want within %v", woke, ttl, limit)
	}
	t.Logf("free-watcher woke %v after the grant of a %v lease was sent", woke, ttl)
	select {
	case <-all:
	case <-time.After(waitTimeout):
		t.Fatalf("no plain watcher wake-up after the holder died")
	}

	o, err := follower.Observe(callCtx(t), name)
	if err != nil || o.Held() || o.Term != held.Term {
		t.Fatalf("Observe after the etcd lease ended: %+v, %v; want free with term %d", o, err, held.Term)
	}
	l := mustGrant(t, follower, name, bob, ttl)
	if l.Term != held.Term+1 || l.Reason != leader.GrantExpiry {
		t.Fatalf("grant after the holder died = %+v; want term %d, reason %q", l, held.Term+1, leader.GrantExpiry)
	}
}

// One lease serves every name of a Store with one ttl, so a name whose
// holder stops renewing must not live on with the others: the Store ends
// it at its deadline.
func TestANameNotRenewedEndsAtItsDeadlineWhileOthersOnItsLeaseAreRenewed(t *testing.T) {
	t.Parallel()
	const ttl = 2 * time.Second
	cli := newClient(t, nil)
	s := newStore(t, cli)
	other := newStore(t, cli, etcd.WithPrefix(s.Prefix()))
	alice, bob := newCandidate("alice"), newCandidate("bob")
	sent := time.Now()
	abandoned := mustGrant(t, s, "abandoned", alice, ttl)
	kept := mustGrant(t, s, "kept", alice, ttl)
	lost := s.Lost("abandoned", alice.Token, abandoned.Term)
	if lost == nil {
		t.Fatal("Lost of a grant the Store keeps is nil")
	}
	free, err := other.WatchFree(t.Context(), "abandoned")
	if err != nil {
		t.Fatal(err)
	}
	stop := time.Now().Add(ttl + 2*time.Second)
	var slowest time.Duration
	for time.Now().Before(stop) {
		start := time.Now()
		if _, err := s.Renew(callCtx(t), "kept", alice.Token, kept.Term, ttl); err != nil {
			t.Fatalf("renewal of the name still renewed: %v (slowest renewal so far: %v)", err, slowest)
		}
		slowest = max(slowest, time.Since(start))
		time.Sleep(ttl / 10)
	}
	select {
	case <-free:
		if since := time.Since(sent); since < ttl {
			t.Fatalf("the unrenewed name was freed %v after its grant was sent, before its ttl %v", since, ttl)
		}
	case <-time.After(waitTimeout):
		t.Fatal("the unrenewed name was not freed")
	}
	select {
	case <-lost:
	default:
		t.Error("Lost channel of the unrenewed grant is open after its deadline")
	}
	l := mustGrant(t, other, "abandoned", bob, time.Minute)
	if l.Term != abandoned.Term+1 || l.Reason != leader.GrantExpiry {
		t.Fatalf("grant of the unrenewed name = %+v; want term %d, reason %q", l, abandoned.Term+1, leader.GrantExpiry)
	}
	if _, err := s.Renew(callCtx(t), "kept", alice.Token, kept.Term, ttl); err != nil {
		t.Fatalf("renewal of the name still renewed, after the other's end: %v", err)
	}
}

func TestARevokedSharedLeaseLosesEveryNameOnIt(t *testing.T) {
	t.Parallel()
	const ttl = time.Minute
	cli := newClient(t, nil)
	s := newStore(t, cli)
	alice := newCandidate("alice")
	var batch []leader.Renewal
	var lost []<-chan struct{}
	for i := range 3 {
		name := fmt.Sprint("job-", i)
		l := mustGrant(t, s, name, alice, ttl)
		batch = append(batch, leader.Renewal{Name: name, Token: alice.Token, Term: l.Term, TTL: ttl})
		lost = append(lost, s.Lost(name, alice.Token, l.Term))
	}
	leases := holderLeases(t, cli, s.Prefix())
	if len(leases) != 1 {
		t.Fatalf("3 names on %d leases; want 1", len(leases))
	}
	for id := range leases {
		if _, err := cli.Revoke(callCtx(t), id); err != nil {
			t.Fatal(err)
		}
	}
	s.RenewBatch(callCtx(t), batch)
	for i, r := range batch {
		if !errors.Is(r.Err, leader.ErrLeaseLost) {
			t.Errorf("renewal of %s after its lease was revoked: %v; want ErrLeaseLost", r.Name, r.Err)
		}
		select {
		case <-lost[i]:
		default:
			t.Errorf("Lost channel of %s open after its lease was revoked", r.Name)
		}
	}
	// The next grant with that ttl gets a new lease.
	l := mustGrant(t, s, "job-0", alice, ttl)
	if l.Term != batch[0].Term+1 {
		t.Fatalf("grant after the revocation has term %d; want %d", l.Term, batch[0].Term+1)
	}
	if _, err := s.Renew(callCtx(t), "job-0", alice.Token, l.Term, ttl); err != nil {
		t.Fatalf("renewal on the new lease: %v", err)
	}
}

func TestRenewBatchJudgesEachNameWithOneKeepAlive(t *testing.T) {
	t.Parallel()
	const ttl = 20 * time.Second
	var n counts
	cli := newClient(t, &n)
	s := newStore(t, cli)
	alice, bob := newCandidate("alice"), newCandidate("bob")
	var batch []leader.Renewal
	for i := range 6 {
		name := fmt.Sprint("job-", i)
		l := mustGrant(t, s, name, alice, ttl)
		batch = append(batch, leader.Renewal{Name: name, Token: alice.Token, Term: l.Term, TTL: ttl})
	}
	// job-1 released, job-2 re-granted (its renewal has a stale term),
	// job-3 taken by bob after a release.
	if err := s.Release(callCtx(t), "job-1", alice.Token, batch[1].Term); err != nil {
		t.Fatal(err)
	}
	mustGrant(t, s, "job-2", alice, ttl)
	if err := s.Release(callCtx(t), "job-3", alice.Token, batch[3].Term); err != nil {
		t.Fatal(err)
	}
	mustGrant(t, s, "job-3", bob, ttl)
	batch[3].Token = alice.Token

	ka := n.keepAlives.Load()
	s.RenewBatch(callCtx(t), batch)
	for i, r := range batch {
		switch i {
		case 1, 2, 3:
			if !errors.Is(r.Err, leader.ErrLeaseLost) {
				t.Errorf("renewal of %s: %v; want ErrLeaseLost", r.Name, r.Err)
			}
		default:
			if r.Err != nil || !r.Lease.Held() || r.Lease.Term != r.Term {
				t.Errorf("renewal of %s: %v, %+v; want renewed", r.Name, r.Err, r.Lease)
			}
		}
	}
	if got := n.keepAlives.Load() - ka; got > 3 {
		// The held names take one keep-alive; the refused ones are
		// checked one by one, at most with a keep-alive each.
		t.Errorf("a batch sent %d keep-alives", got)
	}
	// A round of only the names still held costs one keep-alive.
	held := []leader.Renewal{batch[0], batch[4], batch[5]}
	ka = n.keepAlives.Load()
	s.RenewBatch(callCtx(t), held)
	if got := n.keepAlives.Load() - ka; got != 1 {
		t.Errorf("a round of 3 held names sent %d keep-alives; want 1", got)
	}
	for _, r := range held {
		if r.Err != nil {
			t.Errorf("renewal of %s: %v", r.Name, r.Err)
		}
	}
}

// Electors on etcd elect one leader at a time; a graceful stop hands
// over at once, and a killed leader's name is taken over once etcd ends
// its lease.
func TestElectorsOnEtcd(t *testing.T) {
	t.Parallel()
	const (
		n   = 4
		ttl = 3 * time.Second
	)
	prefix := "test-" + randomHex(6) + "/"
	var (
		mu      sync.Mutex
		leading = make(map[int]bool)
		overlap bool
		terms   []uint64
		elected = make(chan int, 16)
	)
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	defer func() {
		cancel()
		wg.Wait()
	}()
	cancels := make([]context.CancelFunc, n)
	stores := make([]*etcd.Store, n)
	clients := make([]*clientv3.Client, n)
	for i := range n {
		clients[i] = newClient(t, nil)
		stores[i] = newStore(t, clients[i], etcd.WithPrefix(prefix))
		e, err := leader.New(stores[i], leader.Config{
			Name:   "job",
			ID:     fmt.Sprint("e", i),
			TTL:    ttl,
			Logger: slog.New(slog.DiscardHandler),
			OnElected: func(ctx context.Context) {
				term, _ := leader.TermFrom(ctx)
				mu.Lock()
				for j, l := range leading {
					if l && j != i {
						overlap = true
					}
				}
				leading[i] = true
				terms = append(terms, term)
				mu.Unlock()
				elected <- i
			},
			OnDemoted: func() {
				mu.Lock()
				leading[i] = false
				mu.Unlock()
			},
		})
		if err != nil {
			t.Fatal(err)
		}
		ectx, ecancel := context.WithCancel(ctx)
		cancels[i] = ecancel
		wg.Go(func() { _ = e.Run(ectx) })
	}
	wait := func(what string, not ...int) int {
		t.Helper()
		select {
		case i := <-elected:
			for _, j := range not {
				if i == j {
					t.Fatalf("elector %d elected again %s", i, what)
				}
			}
			return i
		case <-time.After(waitTimeout):
			t.Fatalf("no leader elected %v %s", waitTimeout, what)
			return -1
		}
	}
	first := wait("at start")
	start := time.Now()
	cancels[first]() // a graceful stop releases: the next is elected at once
	second := wait("after the first leader stopped", first)
	if took := time.Since(start); took > ttl {
		t.Errorf("handover after a graceful stop took %v; want well under the TTL %v", took, ttl)
	}
	t.Logf("handover after a graceful stop: %v", time.Since(start))

	// Kill the second leader: its Store and client close, so nothing
	// renews or releases its name, which etcd ends with its lease.
	start = time.Now()
	stores[second].Close()
	clients[second].Close()
	third := wait("after the second leader was killed", first, second)
	took := time.Since(start)
	t.Logf("takeover after the leader was killed: %v", took)
	if limit := ttl + 4*time.Second; took > limit {
		t.Errorf("takeover after the leader was killed took %v; want within %v", took, limit)
	}
	_ = third
	mu.Lock()
	defer mu.Unlock()
	if overlap {
		t.Error("two electors led at once")
	}
	for i := 1; i < len(terms); i++ {
		if terms[i] != terms[i-1]+1 {
			t.Errorf("terms went from %d to %d", terms[i-1], terms[i])
		}
	}
}

func TestNewRefusesBadOptions(t *testing.T) {
	t.Parallel()
	cli := newClient(t, nil)
	if _, err := etcd.New(nil); err == nil {
		t.Error("New(nil) succeeded")
	}
	for _, c := range []struct {
		opt  etcd.Option
		want string
	}{
		{etcd.WithPrefix(""), "WithPrefix"},
		{etcd.WithPrefix(strings.Repeat("p", 300)), "at most 256 bytes"},
		{etcd.WithPrefix("\xff"), "UTF-8"},
		{etcd.WithCallTimeout(0), "WithCallTimeout"},
		{etcd.WithCallTimeout(-time.Second), "more than 0"},
	} {
		_, err := etcd.New(cli, c.opt)
		var oe *etcd.OptionError
		if !errors.As(err, &oe) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("New with a bad option: %v; want an *OptionError saying %q", err, c.want)
		}
	}
}

func TestUnreachableEtcdIsUnavailable(t *testing.T) {
	t.Parallel()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close() // nothing listens there now
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{addr}, DialTimeout: time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	s, err := etcd.New(cli, etcd.WithCallTimeout(300*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	start := time.Now()
	_, _, err = s.Acquire(context.Background(), "job", newCandidate("alice"), time.Second)
	if !errors.Is(err, leader.ErrUnavailable) {
		t.Fatalf("Acquire on an unreachable etcd: %v; want ErrUnavailable", err)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("Acquire on an unreachable etcd took %v with a call timeout of 300ms", took)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	_, err = s.Observe(ctx, "job")
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Observe with a deadline on an unreachable etcd: %v; want the context's error", err)
	}
}

func TestAClosedStoreRefusesCalls(t *testing.T) {
	t.Parallel()
	s := newStore(t, newClient(t, nil))
	alice := newCandidate("alice")
	l := mustGrant(t, s, "job", alice, time.Minute)
	ch, err := s.Watch(t.Context(), "job")
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
	if _, open := <-ch; open {
		t.Error("watch channel open after Close")
	}
	if _, _, err := s.Acquire(callCtx(t), "job", alice, time.Minute); !errors.Is(err, etcd.ErrClosed) {
		t.Errorf("Acquire after Close: %v; want ErrClosed", err)
	}
	if _, err := s.Renew(callCtx(t), "job", alice.Token, l.Term, time.Minute); !errors.Is(err, etcd.ErrClosed) || !errors.Is(err, leader.ErrLeaseLost) {
		t.Errorf("Renew after Close: %v; want ErrClosed and ErrLeaseLost", err)
	}
	if err := s.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// A grant whose write failed with an unknown outcome (a timeout, say) may
// have committed: the Store then learns of it once etcd answers, and ends
// it at the failed call's deadline, rather than keeping it alive on its
// shared lease for as long as other names are renewed.
func TestAGrantOfUnknownOutcomeEndsAtItsDeadline(t *testing.T) {
	t.Parallel()
	const ttl = time.Second
	cli := newClient(t, nil)
	s := newStore(t, cli)
	alice := newCandidate("alice")
	kept := mustGrant(t, s, "kept", alice, ttl)
	sent := time.Now()
	l := mustGrant(t, s, "job", alice, ttl)
	s.Forget("job", alice.Token, l.Term) // as if the grant had failed
	free, err := s.WatchFree(t.Context(), "job")
	if err != nil {
		t.Fatal(err)
	}
	// The grant compared against a name never granted, and put the key
	// on the Store's lease for ttl.
	s.Settle("job", alice.Token, l.Term, sent, ttl, etcd.Fence{Lease: holderLease(t, cli, s.Prefix(), "job")})
	deadline := time.Now().Add(waitTimeout)
	for {
		select {
		case <-free:
		case <-time.After(ttl / 5):
		}
		// The other name keeps the shared lease alive.
		if _, err := s.Renew(callCtx(t), "kept", alice.Token, kept.Term, ttl); err != nil {
			t.Fatalf("renewal of the other name: %v", err)
		}
		o, err := s.Observe(callCtx(t), "job")
		if err != nil {
			t.Fatal(err)
		}
		if !o.Held() {
			if since := time.Since(sent); since < ttl {
				t.Fatalf("the grant of unknown outcome ended %v after it was sent, before its ttl %v", since, ttl)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the grant of unknown outcome still held %v after it was sent", waitTimeout)
		}
	}
}

// heldKey is the held-index key of name under the lease id.
func heldKey(prefix string, id clientv3.LeaseID, name string) string {
	return fmt.Sprintf("%sheld/%016x/%s", prefix, int64(id), name)
}

// renewedFor renews name for x through s with ttl, and checks that the
// renewal keeps what it told: the holder key is on an etcd lease of at
// least ttl, and another candidate, trying through c once a shorter lease
// would have ended, is refused while the renewal's ttl lasts.
func renewedFor(t *testing.T, cli *clientv3.Client, s, c *etcd.Store, name string, x leader.Candidate, term uint64, ttl time.Duration) {
	t.Helper()
	sent := time.Now()
	r, err := s.Renew(callCtx(t), name, x.Token, term, ttl)
	if err != nil {
		t.Fatalf("renewal for %v: %v", ttl, err)
	}
	ttlResp, err := cli.TimeToLive(callCtx(t), holderLease(t, cli, s.Prefix(), name))
	if err != nil {
		t.Fatal(err)
	}
	if got := time.Duration(ttlResp.GrantedTTL) * time.Second; got < ttl {
		t.Errorf("a renewal told the holder %v remains, but its key is on an etcd lease of %v", r.Remaining, got)
	}
	// A lease of a second ends within about 1.5s of its last keep-alive.
	time.Sleep(2500 * time.Millisecond)
	l, granted, err := c.Acquire(callCtx(t), name, newCandidate("y"), time.Second)
	if since := time.Since(sent); err == nil && granted && since < ttl {
		t.Fatalf("INVARIANT 1: another candidate granted term %d %v after a renewal for %v was sent", l.Term, since, ttl)
	}
}

// F1: a renewal with ttl 10s, of a grant made through another Store with
// ttl 1s (on that Store's lease of a second), failed with an unknown
// outcome and did not commit. The Store must not take the key for one of
// its own on the other's lease with a ttl of 10s, and renew it quickly:
// that keeps a lease of a second alive while telling the holder 10s.
func TestARenewalOfAnotherStoresGrantIsNeverQuick(t *testing.T) {
	t.Parallel()
	cli := newClient(t, nil)
	a := newStore(t, cli)
	b := newStore(t, cli, etcd.WithPrefix(a.Prefix()))
	c := newStore(t, cli, etcd.WithPrefix(a.Prefix()))
	x := newCandidate("x")
	mustGrant(t, a, "other", x, 10*time.Second) // a's lease for 10s
	a10 := holderLease(t, cli, a.Prefix(), "other")
	l := mustGrant(t, b, "job", x, time.Second)
	st, err := a.ReadState(callCtx(t), "job") // what a's renewal read
	if err != nil {
		t.Fatal(err)
	}
	b.Close() // b's process is gone; x renews through a
	a.Settle("job", x.Token, l.Term, time.Now(), 10*time.Second, etcd.FenceOf(st, a10))
	renewedFor(t, cli, a, c, "job", x, l.Term, 10*time.Second)
}

// F1: a renewal that moved a grant of 10s onto the Store's lease of a
// second (ttl 1s) committed, but the Store saw a timeout. Once settled,
// the Store's record of the grant must say 1s, so that the next renewal
// with 10s moves the key back, rather than keeping the lease of a second
// alive and telling the holder 10s.
func TestASettledRenewalKeepsTheTTLOfItsLease(t *testing.T) {
	t.Parallel()
	cli := newClient(t, nil)
	a := newStore(t, cli)
	c := newStore(t, cli, etcd.WithPrefix(a.Prefix()))
	x := newCandidate("x")
	mustGrant(t, a, "other", x, time.Second) // a's lease for 1s
	a1 := holderLease(t, cli, a.Prefix(), "other")
	l := mustGrant(t, a, "job", x, 10*time.Second)
	a10 := holderLease(t, cli, a.Prefix(), "job")
	st, err := a.ReadState(callCtx(t), "job")
	if err != nil {
		t.Fatal(err)
	}
	f := etcd.FenceOf(st, a1)
	// The write of a's renewal with 1s, as renewSlowly makes it.
	var rec map[string]any
	if err := json.Unmarshal(f.Record, &rec); err != nil {
		t.Fatal(err)
	}
	rec["ttl"] = int64(time.Second)
	recJSON, _ := json.Marshal(rec)
	p := a.Prefix()
	resp, err := cli.Txn(callCtx(t)).If(
		clientv3.Compare(clientv3.ModRevision(p+"names/job/holder"), "=", f.HolderRev),
		clientv3.Compare(clientv3.ModRevision(p+"names/job/record"), "=", f.RecordRev),
	).Then(
		clientv3.OpPut(p+"names/job/holder", x.Token, clientv3.WithLease(a1)),
		clientv3.OpPut(heldKey(p, a1, "job"), fmt.Sprintf("%d %s", l.Term, x.Token), clientv3.WithLease(a1)),
		clientv3.OpPut(p+"names/job/record", string(recJSON)),
		clientv3.OpDelete(heldKey(p, a10, "job")),
	).Commit()
	if err != nil || !resp.Succeeded {
		t.Fatalf("the renewal's write: %v, %v", err, resp)
	}
	a.Settle("job", x.Token, l.Term, time.Now(), time.Second, f)
	renewedFor(t, cli, a, c, "job", x, l.Term, 10*time.Second)
}

// F2: a grant's write of unknown outcome that etcd applies only after
// the Store's settle began (a proposal still in flight when the client
// gave up) must not commit: nobody would ever end it while other names
// keep the shared lease alive.
func TestAWriteOfUnknownOutcomeIsFencedOff(t *testing.T) {
	t.Parallel()
	const ttl = time.Second
	cli := newClient(t, nil)
	s := newStore(t, cli)
	other := newStore(t, cli, etcd.WithPrefix(s.Prefix()))
	alice, x, y := newCandidate("alice"), newCandidate("x"), newCandidate("y")
	kept := mustGrant(t, s, "kept", alice, ttl)
	lease := holderLease(t, cli, s.Prefix(), "kept")
	st, err := s.ReadState(callCtx(t), "job") // what x's grant read
	if err != nil {
		t.Fatal(err)
	}
	f := etcd.FenceOf(st, lease)
	began := time.Now()
	s.Settle("job", x.Token, 1, began, ttl, f)
	// Then etcd applies the grant's transaction, compares and all.
	p := s.Prefix()
	rec := fmt.Sprintf(`{"term":1,"id":"x","acquired":%d,"ttl":%d}`, time.Now().UnixNano(), ttl)
	resp, err := cli.Txn(callCtx(t)).If(
		clientv3.Compare(clientv3.ModRevision(p+"names/job/holder"), "=", f.HolderRev),
		clientv3.Compare(clientv3.ModRevision(p+"names/job/record"), "=", f.RecordRev),
		clientv3.Compare(clientv3.ModRevision(p+"names/job/reserved"), "=", 0),
	).Then(
		clientv3.OpPut(p+"names/job/holder", x.Token, clientv3.WithLease(lease)),
		clientv3.OpPut(p+"names/job/record", rec),
		clientv3.OpPut(heldKey(p, lease, "job"), "1 "+x.Token, clientv3.WithLease(lease)),
	).Commit()
	if err != nil {
		t.Fatal(err)
	}
	if resp.Succeeded {
		t.Error("a grant of unknown outcome committed after settle")
	}
	// x's Elector gave up; alice renews "kept", and so the shared lease.
	for time.Since(began) < 3*ttl {
		if _, err := s.Renew(callCtx(t), "kept", alice.Token, kept.Term, ttl); err != nil {
			t.Fatal(err)
		}
		time.Sleep(ttl / 4)
	}
	if l, granted, err := other.Acquire(callCtx(t), "job", y, ttl); err != nil || !granted {
		t.Fatalf("another candidate's Acquire %v after the grant of unknown outcome: granted %v, %v: %+v", time.Since(began), granted, err, l)
	}
}

// blackHole returns the address of a listener that accepts connections
// and never answers, closed when t ends.
func blackHole(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		<-done
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	return ln.Addr().String()
}

// blackHoleStore returns a Store on a client of a black hole.
func blackHoleStore(t *testing.T, opts ...etcd.Option) *etcd.Store {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{blackHole(t)}, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	s, err := etcd.New(cli, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// F3: a call waiting for another's grant of a lease returns when its own
// context ends.
func TestACallWaitingForAnothersGrantHonoursItsContext(t *testing.T) {
	t.Parallel()
	s := blackHoleStore(t, etcd.WithCallTimeout(time.Minute))
	alice, bob := newCandidate("alice"), newCandidate("bob")
	var wg sync.WaitGroup
	defer wg.Wait()
	defer s.Close()                                                                 // ends alice's Enlist
	wg.Go(func() { _ = s.Enlist(context.Background(), "job", alice, time.Second) }) // grants, and waits
	time.Sleep(200 * time.Millisecond)
	ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, _, err := s.Acquire(ctx, "job", bob, time.Second)
	took := time.Since(start)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Acquire with a 100ms context: %v; want the context's error", err)
	}
	if took > 2*time.Second {
		t.Errorf("Acquire with a 100ms context returned after %v", took)
	}
	t.Logf("Acquire with a 100ms context returned after %v: %v", took, err)
}

// F4: settle's verdict on a read that a later grant made stale must not
// replace the Store's record of that grant, nor close its Lost channel.
func TestAStaleSettleKeepsANewerGrant(t *testing.T) {
	t.Parallel()
	cli := newClient(t, nil)
	s := newStore(t, cli)
	x, y := newCandidate("x"), newCandidate("y")
	lx := mustGrant(t, s, "job", x, time.Minute)
	f := etcd.Fence{Lease: holderLease(t, cli, s.Prefix(), "job")} // x's grant read a name never granted
	st, err := s.ReadState(callCtx(t), "job")                      // settle's read, showing x's grant ...
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Release(callCtx(t), "job", x.Token, lx.Term); err != nil {
		t.Fatal(err)
	}
	ly := mustGrant(t, s, "job", y, time.Minute) // ... stale once y is granted
	lost := s.Lost("job", y.Token, ly.Term)
	s.Settled("job", x.Token, lx.Term, time.Now(), time.Minute, f, st)
	select {
	case <-lost:
		t.Fatal("the Lost channel of y's grant closed while y holds")
	default:
	}
	if s.Lost("job", y.Token, ly.Term) == nil {
		t.Error("the Store forgot y's grant")
	}
	if s.Lost("job", x.Token, lx.Term) != nil {
		t.Error("the Store keeps x's grant, long over")
	}
	if _, err := s.Renew(callCtx(t), "job", y.Token, ly.Term, time.Minute); err != nil {
		t.Errorf("y's renewal: %v", err)
	}
}

// F5: a renewal that began after the Store's deadline for the grant (its
// expiry timer late) is refused, and the expiry runs.
func TestARenewalAfterTheDeadlineIsRefused(t *testing.T) {
	t.Parallel()
	s := newStore(t, newClient(t, nil))
	alice := newCandidate("alice")
	l := mustGrant(t, s, "job", alice, time.Minute)
	lost := s.Lost("job", alice.Token, l.Term)
	s.SetDeadline("job", time.Now().Add(-time.Millisecond))
	if r, err := s.Renew(callCtx(t), "job", alice.Token, l.Term, time.Minute); !errors.Is(err, leader.ErrLeaseLost) {
		t.Fatalf("renewal after the deadline: %v, %+v; want ErrLeaseLost", err, r)
	}
	select {
	case <-lost:
	case <-time.After(waitTimeout):
		t.Fatal("Lost channel open after a renewal refused for its deadline")
	}
	for deadline := time.Now().Add(waitTimeout); ; time.Sleep(10 * time.Millisecond) {
		o, err := s.Observe(callCtx(t), "job")
		if err != nil {
			t.Fatal(err)
		}
		if !o.Held() {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the key of a grant past its deadline is still there")
		}
	}
}

// F5: a renewal or release that Close cuts short fails with ErrClosed
// and leader.ErrLeaseLost, as one after Close does.
func TestARenewalOrReleaseCutShortByCloseIsLost(t *testing.T) {
	t.Parallel()
	s := blackHoleStore(t)
	alice := newCandidate("alice")
	var errs [2]error
	var wg sync.WaitGroup
	wg.Go(func() { _, errs[0] = s.Renew(context.Background(), "job", alice.Token, 1, time.Second) })
	wg.Go(func() { errs[1] = s.Release(context.Background(), "job", alice.Token, 1) })
	time.Sleep(200 * time.Millisecond)
	s.Close()
	wg.Wait()
	for i, what := range []string{"Renew", "Release"} {
		if !errors.Is(errs[i], etcd.ErrClosed) || !errors.Is(errs[i], leader.ErrLeaseLost) {
			t.Errorf("%s cut short by Close: %v; want ErrClosed and ErrLeaseLost", what, errs[i])
		}
	}
}

// F5: a Store on a client without a connection of its own (NewCtxClient,
// as an etcd proxy makes) keeps its leases alive.
func TestAStoreOnAClientWithoutAConnection(t *testing.T) {
	t.Parallel()
	real := newClient(t, nil)
	cli := clientv3.NewCtxClient(t.Context())
	cli.KV, cli.Lease, cli.Watcher = real.KV, real.Lease, real.Watcher
	s := newStore(t, cli)
	alice := newCandidate("alice")
	l := mustGrant(t, s, "job", alice, time.Minute)
	if _, err := s.Renew(callCtx(t), "job", alice.Token, l.Term, time.Minute); err != nil {
		t.Fatalf("renewal: %v", err)
	}
	mustGrant(t, s, "other", alice, time.Minute) // a keep-alive of the shared lease
}

// F5: a watch whose client is closed does not wake its watchers over and
// over.
func TestAWatchOfAClosedClientStaysQuiet(t *testing.T) {
	t.Parallel()
	cli := newClient(t, nil)
	s := newStore(t, cli)
	ch, err := s.Watch(t.Context(), "job")
	if err != nil {
		t.Fatal(err)
	}
	cli.Close()
	n := 0
	for timeout := time.After(3 * time.Second); ; {
		select {
		case _, ok := <-ch:
			if !ok {
				t.Fatal("watch channel closed while its context lasts")
			}
			n++
			continue
		case <-timeout:
		}
		break
	}
	if n > 2 {
		t.Errorf("%d wake-ups in 3s after the client closed", n)
	}
}
