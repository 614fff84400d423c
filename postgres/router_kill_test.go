package postgres

import (
	"bufio"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
	"github.com/leaderelect/leader/internal/pgtest"
)

// The durable stream under leader kills: candidates run as real child
// processes (this test binary, re-executed to run TestRouterChildProcess),
// the leader among them is SIGKILLed in the middle of a stream of durable
// messages, and the deliveries that the children recorded are checked for
// losses and order.

// Environment of a child process. TestRouterChildProcess does nothing
// unless routerChildURL is set.
const (
	routerChildURL      = "LEADER_ROUTER_CHILD_DATABASE_URL"
	routerChildInstance = "LEADER_ROUTER_CHILD_INSTANCE"
	routerChildTTL      = "LEADER_ROUTER_CHILD_TTL"
	routerChildStore    = "LEADER_ROUTER_CHILD_STORE" // "lease" (or, later, "advisory")
	routerChildOut      = "LEADER_ROUTER_CHILD_OUT"   // the file deliveries are appended to
)

// routerStreamChannels are the channels of the stream; routerStreamElection
// is the election the children campaign in.
var routerStreamChannels = []string{"orders", "payments", "emails", "audit"}

const routerStreamElection = "router-stream"

// TestRouterChildProcess is a candidate of TestRouterDurableStreamSurvivesLeaderKills,
// when run as its child process; otherwise it returns at once. It campaigns
// and, while it leads, serves a Router whose handler appends one line per
// message to its file, "instance term channel seq", with a single write(2)
// before returning nil, so that every line recorded survives a SIGKILL. It
// runs until its standard input closes (the parent ended) or it is killed.
func TestRouterChildProcess(t *testing.T) {
	url := os.Getenv(routerChildURL)
	if url == "" {
		return
	}
	instance := os.Getenv(routerChildInstance)
	ttl, err := time.ParseDuration(os.Getenv(routerChildTTL))
	if err != nil {
		t.Fatalf("%s: %v", routerChildTTL, err)
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo})).With("instance", instance)

	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		stop()
	}()

	out, err := os.OpenFile(os.Getenv(routerChildOut), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()

	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	opts := Options{Logger: log}
	store, closeStore, err := routerChildStoreFor(ctx, os.Getenv(routerChildStore), pool, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer closeStore()

	r, err := NewRouter(pool, opts)
	if err != nil {
		t.Fatal(err)
	}
	for _, channel := range routerStreamChannels {
		err := r.Handle(channel, func(ctx context.Context, m Message) error {
			// One write(2), unbuffered: the line is in the file before
			// the message can be deleted.
			_, err := out.Write([]byte(fmt.Sprintf("%s %d %s %s\n", instance, m.Term, m.Channel, m.Payload)))
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	e, err := leader.New(store, leader.Config{
		Name:   routerStreamElection,
		ID:     instance,
		TTL:    ttl,
		Logger: log,
		OnElected: func(ctx context.Context) {
			if err := r.Serve(ctx); err != nil {
				log.Error("Serve", slog.Any("error", err))
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Run(ctx); err != nil {
		t.Fatal(err)
	}
}

// routerChildStoreFor returns the store of the strategy the child was told
// to use, and how to close it.
func routerChildStoreFor(ctx context.Context, strategy string, pool *pgxpool.Pool, opts Options) (leader.Store, func(), error) {
	switch strategy {
	case "lease":
		s, err := NewLeaseStore(pool, opts)
		if err != nil {
			return nil, nil, err
		}
		return s, s.Close, nil
	case "advisory":
		s, err := NewAdvisoryStore(ctx, pool, opts)
		if err != nil {
			return nil, nil, err
		}
		return s, s.Close, nil
	default:
		return nil, nil, fmt.Errorf("%s %q: want lease or advisory", routerChildStore, strategy)
	}
}

// routerChild is a running child process.
type routerChild struct {
	instance string
	cmd      *exec.Cmd
	logFile  string
	once     sync.Once
	err      error // from Wait
}

// kill SIGKILLs the child and waits for it; it may be called again.
func (c *routerChild) kill() {
	c.once.Do(func() {
		_ = c.cmd.Process.Signal(syscall.SIGKILL)
		c.err = c.cmd.Wait()
	})
}

// routerStream runs the children of one kill test.
type routerStream struct {
	t        *testing.T
	url      string
	strategy string
	dir      string
	ttl      time.Duration

	mu       sync.Mutex
	children map[string]*routerChild
}

// start starts a child named instance, killed when the test ends.
func (s *routerStream) start(instance string) *routerChild {
	t := s.t
	t.Helper()
	c := &routerChild{instance: instance, logFile: filepath.Join(s.dir, instance+".log")}
	logf, err := os.Create(c.logFile)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close() // the child has its own copy
	c.cmd = exec.Command(os.Args[0], "-test.run=^TestRouterChildProcess$", "-test.count=1", "-test.timeout=5m")
	c.cmd.Env = append(os.Environ(),
		routerChildURL+"="+s.url,
		routerChildInstance+"="+instance,
		routerChildTTL+"="+s.ttl.String(),
		routerChildStore+"="+s.strategy,
		routerChildOut+"="+s.deliveries(instance),
	)
	c.cmd.Stdout, c.cmd.Stderr = logf, logf
	// The child stops when its standard input closes, so that it does not
	// outlive a parent that died without cleaning up.
	if _, err := c.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	if err := c.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.kill)
	s.mu.Lock()
	s.children[instance] = c
	s.mu.Unlock()
	return c
}

// deliveries is the file in which instance records its deliveries.
func (s *routerStream) deliveries(instance string) string {
	return filepath.Join(s.dir, instance+".deliveries")
}

// delivery is one line a child recorded.
type delivery struct {
	instance string
	term     uint64
	channel  string
	seq      int
}

// read returns every delivery recorded so far, ordered by term (one
// instance leads per term) and, within a term, in the order recorded.
func (s *routerStream) read() []delivery {
	t := s.t
	t.Helper()
	s.mu.Lock()
	instances := slices.Sorted(maps.Keys(s.children))
	s.mu.Unlock()
	var all []delivery
	for _, instance := range instances {
		f, err := os.Open(s.deliveries(instance))
		if errors.Is(err, os.ErrNotExist) {
			continue // never led
		}
		if err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			var d delivery
			if _, err := fmt.Sscanf(sc.Text(), "%s %d %s %d", &d.instance, &d.term, &d.channel, &d.seq); err != nil {
				t.Fatalf("%s: bad line %q: %v", instance, sc.Text(), err)
			}
			all = append(all, d)
		}
		f.Close()
		if err := sc.Err(); err != nil {
			t.Fatal(err)
		}
	}
	slices.SortStableFunc(all, func(a, b delivery) int { return cmp.Compare(a.term, b.term) })
	return all
}

// latest returns the instance that recorded the latest term, the term, and
// how many deliveries it recorded in that term.
func (s *routerStream) latest() (instance string, term uint64, n int) {
	all := s.read()
	for i := len(all) - 1; i >= 0 && all[i].term == all[len(all)-1].term; i-- {
		instance, term = all[i].instance, all[i].term
		n++
	}
	return instance, term, n
}

// dumpLogs shows the children's logs when the test failed.
func (s *routerStream) dumpLogs() {
	if !s.t.Failed() {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for name, c := range s.children {
		b, _ := os.ReadFile(c.logFile)
		lines := strings.Split(strings.TrimSpace(string(b)), "\n")
		s.t.Logf("log of %s (exit: %v), last lines:\n%s", name, c.err, strings.Join(lines[max(0, len(lines)-30):], "\n"))
	}
}

func TestRouterDurableStreamSurvivesLeaderKills(t *testing.T) {
	// Not parallel: three child processes and a steady stream want the
	// machine to themselves, so that the timing bounds hold with room.
	for _, strategy := range []string{"lease", "advisory"} {
		t.Run(strategy, func(t *testing.T) { testDurableStream(t, strategy) })
	}
}

// testDurableStream runs the durable stream with Electors of strategy.
func testDurableStream(t *testing.T, strategy string) {
	start := time.Now()
	url := pgtest.NewDatabase(t)
	pool := pgtest.OpenPool(t, url)
	if err := Migrate(routerCallCtx(t), pool, Options{}); err != nil {
		t.Fatal(err)
	}
	s := &routerStream{t: t, url: url, strategy: strategy, dir: t.TempDir(), ttl: leader.MinTTL, children: map[string]*routerChild{}}
	t.Cleanup(s.dumpLogs) // runs before the children are killed: t.Cleanup is LIFO
	for i := range 3 {
		s.start(fmt.Sprint("c", i))
	}
	next := 3

	const (
		perChannel = 2500 // 10,000 messages over 4 channels
		pace       = 12 * time.Second
	)
	total := perChannel * len(routerStreamChannels)
	sender, err := NewRouter(pool, Options{})
	if err != nil {
		t.Fatal(err)
	}
	var sent atomic.Int64
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	var producers sync.WaitGroup
	defer func() {
		cancel() // stops the producers early if the test failed
		producers.Wait()
	}()
	for _, channel := range routerStreamChannels {
		producers.Go(func() {
			interval := pace / perChannel
			begin := time.Now()
			for seq := 1; seq <= perChannel; seq++ {
				// A steady pace: message seq goes out at begin+seq*interval.
				timer := time.NewTimer(time.Until(begin.Add(time.Duration(seq) * interval)))
				select {
				case <-ctx.Done():
					timer.Stop()
					return
				case <-timer.C:
				}
				if err := sender.NotifyDurable(ctx, channel, strconv.Itoa(seq)); err != nil {
					if ctx.Err() == nil {
						t.Errorf("NotifyDurable %s %d: %v", channel, seq, err)
					}
					return
				}
				sent.Add(1)
			}
		})
	}

	// Kill the leader twice in the middle of the stream, starting a
	// replacement each time. The first kill hits a leader keeping pace, a
	// third of the way in. The second hits its successor soon after its
	// election, while it catches up on the messages sent during the
	// failover (with the lease strategy, a TTL's worth), handling them back
	// to back.
	var killed []string
	kill := func(victim string, term uint64, how string) {
		var backlog int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM leader_messages").Scan(&backlog); err != nil {
			t.Fatal(err)
		}
		s.mu.Lock()
		c := s.children[victim]
		s.mu.Unlock()
		c.kill()
		killed = append(killed, fmt.Sprintf("%s (term %d) %s, %d sent, %d waiting", victim, term, how, sent.Load(), backlog))
		s.start(fmt.Sprint("c", next))
		next++
	}
	electortest.Eventually(t, time.Minute, "a third of the stream to be sent", func() bool { return sent.Load() >= int64(total)/3 || t.Failed() })
	victim, term, _ := s.latest()
	if victim == "" {
		t.Fatalf("no deliveries recorded after %d messages were sent", sent.Load())
	}
	kill(victim, term, "keeping pace")
	electortest.Eventually(t, 20*time.Second, "a new leader to catch up", func() bool {
		victim, newTerm, n := s.latest()
		if newTerm > term && n >= 20 {
			kill(victim, newTerm, "just elected")
			term = newTerm
			return true
		}
		return false
	})
	electortest.Eventually(t, 20*time.Second, "a third leader to deliver", func() bool {
		_, newTerm, _ := s.latest()
		return newTerm > term
	})
	producers.Wait()
	if t.Failed() {
		return
	}
	electortest.Eventually(t, time.Minute, "every message to be handled and deleted", func() bool {
		var n int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM leader_messages").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 0
	})

	// Deliveries are ordered by term, and one instance leads per term, so
	// this is the order in which they happened.
	all := s.read()
	var (
		seen       = map[string][]int{} // channel -> deliveries of each seq
		firstNext  = map[string]int{}   // channel -> next seq expected first
		lastInTerm = map[string]int{}   // "term channel" -> last seq delivered
		termOf     = map[uint64]string{}
		problems   = 0
	)
	problem := func(format string, args ...any) {
		if problems++; problems <= 10 {
			t.Errorf(format, args...)
		}
	}
	for _, channel := range routerStreamChannels {
		seen[channel] = make([]int, perChannel+1)
		firstNext[channel] = 1
	}
	for _, d := range all {
		if owner, ok := termOf[d.term]; ok && owner != d.instance {
			problem("term %d delivered by both %s and %s", d.term, owner, d.instance)
		}
		termOf[d.term] = d.instance
		if seen[d.channel] == nil || d.seq < 1 || d.seq > perChannel {
			problem("delivered %s %d, which was never sent", d.channel, d.seq)
			continue
		}
		if seen[d.channel][d.seq] == 0 {
			if d.seq != firstNext[d.channel] {
				problem("%s %d delivered for the first time (term %d) when %d was due", d.channel, d.seq, d.term, firstNext[d.channel])
			}
			firstNext[d.channel] = max(firstNext[d.channel], d.seq+1)
		}
		seen[d.channel][d.seq]++
		key := fmt.Sprint(d.term, " ", d.channel)
		if last, ok := lastInTerm[key]; ok && d.seq <= last {
			problem("term %d delivered %s %d after %d", d.term, d.channel, d.seq, last)
		}
		lastInTerm[key] = d.seq
	}
	lost, duplicates := 0, 0
	for _, channel := range routerStreamChannels {
		for seq := 1; seq <= perChannel; seq++ {
			switch n := seen[channel][seq]; {
			case n == 0:
				lost++
				problem("%s %d was never delivered", channel, seq)
			case n > 1:
				duplicates += n - 1
			}
		}
	}
	t.Logf("killed: %s", strings.Join(killed, "; "))
	t.Logf("durable stream: %d messages, %d lost, %d duplicates, %d leaders (%d deliveries, %v)",
		total, lost, duplicates, len(termOf), len(all), time.Since(start).Round(time.Second))
	if lost > 0 {
		t.Errorf("%d of %d messages lost", lost, total)
	}
	if len(killed) != 2 || len(termOf) < 3 {
		t.Errorf("%d kills, %d leaders delivered; want 2 kills making at least 3 leaders", len(killed), len(termOf))
	}
}
