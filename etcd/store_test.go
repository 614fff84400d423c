package etcd_test

import (
	"context"
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
	s.Settle("job", alice.Token, l.Term, sent, ttl)
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
