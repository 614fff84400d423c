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
// its goroutine; this one keeps reading its input while it waits, and gives
// up its pending chunks when the input ends and they cannot be delivered
// within flushTimeout.
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
	// flush delivers what is pending, each chunk when it is due, giving up
	// on the first that cannot be delivered.
	flush := func() {
		for _, c := range queue {
			time.Sleep(time.Until(c.Timestamp.Add(delay)))
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
