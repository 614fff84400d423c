package faults_test

import (
	"time"

	"github.com/Shopify/toxiproxy/v2/stream"
	"github.com/Shopify/toxiproxy/v2/toxics"
)

// delayToxic delays every chunk by Latency milliseconds, in order, like
// toxiproxy's latency toxic, but never blocks for ever once its link is
// going away. The latency toxic of v2.12 waits for ever to hand a delayed
// chunk to a link writer that has already stopped (its connection closed,
// which pgx does to every connection whose query is cancelled), and leaks
// its goroutine; this one keeps reading its input while it waits, and when
// it is interrupted or its input ends it passes its pending chunks on at
// once, giving up on those that cannot be delivered within flushTimeout.
type delayToxic struct {
	Latency int64 `json:"latency"` // milliseconds
}

// delayToxicType is the toxic type name delayToxic is registered under.
const delayToxicType = "faults_delay"

// flushTimeout bounds the wait to deliver each chunk still pending when the
// toxic is interrupted or its input ends.
const flushTimeout = 100 * time.Millisecond

func init() { toxics.Register(delayToxicType, new(delayToxic)) }

func (d *delayToxic) Pipe(stub *toxics.ToxicStub) {
	delay := time.Duration(d.Latency) * time.Millisecond
	var queue []*stream.StreamChunk
	// flush passes on what is pending at once, without its delay, giving
	// up on the first chunk that cannot be delivered: the toxic is being
	// removed or its link is closing, and must not outlive it by waiting
	// out delays (a test's leak check would catch it).
	flush := func() {
		for _, c := range queue {
			if stub.WriteOutput(c, flushTimeout) != nil {
				return
			}
		}
	}
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		var out chan<- *stream.StreamChunk
		var next *stream.StreamChunk
		if len(queue) > 0 {
			if wait := time.Until(queue[0].Timestamp.Add(delay)); wait > 0 {
				timer.Reset(wait)
			} else {
				out, next = stub.Output, queue[0]
			}
		}
		select {
		case <-stub.Interrupt:
			flush()
			return
		case c := <-stub.Input:
			if c == nil {
				flush()
				stub.Close()
				return
			}
			queue = append(queue, c)
		case out <- next:
			queue = queue[1:]
		case <-timer.C:
		}
	}
}
