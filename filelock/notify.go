package filelock

import (
	"os"
	"sync"
)

// A hint is what the kernel reported about one name's files. Hints only say
// where to look: pollLoop then looks at the name as it does every poll
// interval.
type hint uint8

const (
	hintState hint = 1 << iota // the state file was replaced (or written)
	hintLock                   // a leader lock file was closed, perhaps by a dying holder
)

// notifier passes on to pollLoop what the kernel reports about the files
// of a Store's directory (see openNotifier), coalesced: one value on ready
// stands for all the news since pollLoop last took it.
type notifier struct {
	f     *os.File      // where the reports are read, by run
	done  chan struct{} // closed when run returns
	ready chan struct{} // (1) there is news to take

	mu     sync.Mutex
	hints  map[string]hint // by the encoding of the name whose files changed
	lost   bool            // reports were lost: anything may have changed
	failed bool            // no more reports will come
}

func newNotifier(f *os.File) *notifier {
	return &notifier{
		f:     f,
		done:  make(chan struct{}),
		ready: make(chan struct{}, 1),
		hints: make(map[string]hint),
	}
}

// take returns and forgets the news.
func (n *notifier) take() (hints map[string]hint, lost, failed bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	hints, lost, failed = n.hints, n.lost, n.failed
	n.hints, n.lost = make(map[string]hint), false
	return hints, lost, failed
}

// signal tells pollLoop that there is news. The caller holds n.mu.
func (n *notifier) signal() {
	select {
	case n.ready <- struct{}{}:
	default:
	}
}

// fail records that no more reports will come.
func (n *notifier) fail() {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.failed = true
	n.signal()
}

// close stops reading, which ends run, and waits for it.
func (n *notifier) close() {
	n.f.Close()
	<-n.done
}
