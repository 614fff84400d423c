package postgres_test

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/internal/electortest"
)

// BenchmarkHandover measures a graceful handover on PostgreSQL: from the
// leader's Resign call to another instance leading. The TTL is 10s, so a
// handover that waited for the lease to expire would show it. It reports
// the median and the worst handover as ms/handover metrics.
//
//	go test -run '^$' -bench Handover ./postgres/
func BenchmarkHandover(b *testing.B) {
	s := newElection(b)
	var es []*leader.Elector
	for i := range 3 {
		id := fmt.Sprint("c", i)
		e := s.elector(b, s.store, "bench-handover", id, id, 10*time.Second, func(c *leader.Config) {
			c.RetryInterval = 50 * time.Millisecond // the resigner's sit-out
		})
		es = append(es, e)
		electortest.Run(b, e)
	}
	oneLeader := func() bool { return len(electortest.Leaders(es)) == 1 }
	electortest.Eventually(b, 10*time.Second, "a leader", oneLeader)

	var took []time.Duration
	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		time.Sleep(60 * time.Millisecond) // let the last resigner's sit-out end
		electortest.Eventually(b, 10*time.Second, "a leader", oneLeader)
		old := electortest.Leaders(es)[0]
		b.StartTimer()
		start := time.Now()
		if err := old.Resign(b.Context()); err != nil {
			b.Fatal(err)
		}
		for {
			if l := electortest.Leaders(es); len(l) == 1 && l[0] != old {
				break
			}
			time.Sleep(50 * time.Microsecond) // poll interval
		}
		took = append(took, time.Since(start))
	}
	b.StopTimer()
	slices.Sort(took)
	b.ReportMetric(float64(took[len(took)/2].Microseconds())/1000, "median-ms/handover")
	b.ReportMetric(float64(took[len(took)-1].Microseconds())/1000, "max-ms/handover")
}

// BenchmarkCrashFailover measures failover after a leader dies without
// releasing (its renewals and release stop reaching the database): from
// the crash to another instance leading, with a 2s TTL. Each iteration
// takes about the time the lease had left, so run it with a small -benchtime,
// for example -benchtime=5x. It reports the median and the worst.
//
//	go test -run '^$' -bench CrashFailover -benchtime=5x ./postgres/
func BenchmarkCrashFailover(b *testing.B) {
	const ttl = 2 * time.Second
	var took []time.Duration
	for i := range b.N {
		b.StopTimer()
		s := newElection(b)
		name := fmt.Sprint("bench-crash-", i)
		crashable := &crashStore{Store: s.store}
		a := s.elector(b, crashable, name, "a", "a", ttl)
		stopA := electortest.Run(b, a)
		electortest.Eventually(b, 10*time.Second, "a to lead", a.IsLeader)
		f := s.elector(b, s.store, name, "f", "f", ttl)
		electortest.Run(b, f)
		electortest.Eventually(b, 10*time.Second, "f to follow", func() bool { return f.Status().Leader == "a" })
		b.StartTimer()
		start := time.Now()
		crashable.crash()
		stopA()
		electortest.Eventually(b, 3*ttl, "f to lead", f.IsLeader)
		took = append(took, time.Since(start))
	}
	b.StopTimer()
	slices.Sort(took)
	b.ReportMetric(float64(took[len(took)/2].Milliseconds()), "median-ms/failover")
	b.ReportMetric(float64(took[len(took)-1].Milliseconds()), "max-ms/failover")
}
