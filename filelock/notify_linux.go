package filelock

import (
	"encoding/binary"
	"os"
	"strings"
	"syscall"
	"time"
)

// notifyMask is what the notifier asks inotify(7) to report about the
// directory and its files: a file renamed into it (a new state), created in
// it, or closed after being opened for writing. Every Store opens the
// leader lock files for writing, so the last is also how the death of a
// holder's process shows: the kernel closes its files. The directory's own
// removal or renaming ends the reports.
const notifyMask = syscall.IN_MOVED_TO | syscall.IN_CREATE | syscall.IN_CLOSE_WRITE |
	syscall.IN_DELETE_SELF | syscall.IN_MOVE_SELF | syscall.IN_ONLYDIR

// openNotifier starts reading the kernel's reports on the files of dir,
// from an inotify(7) instance of its own. It fails when inotify is
// unavailable, for example when the user has max_user_instances open
// already.
func openNotifier(dir string) (*notifier, error) {
	fd, err := syscall.InotifyInit1(syscall.IN_NONBLOCK | syscall.IN_CLOEXEC)
	if err != nil {
		return nil, os.NewSyscallError("inotify_init1", err)
	}
	if _, err := syscall.InotifyAddWatch(fd, dir, notifyMask); err != nil {
		syscall.Close(fd)
		return nil, &os.PathError{Op: "inotify_add_watch", Path: dir, Err: err}
	}
	// The descriptor is non-blocking, so the runtime's poller takes it: Read
	// waits there, without holding a thread, and Close ends the wait. Only
	// files in the poller have deadlines, which tells whether it took it.
	f := os.NewFile(uintptr(fd), "inotify "+dir)
	if err := f.SetReadDeadline(time.Time{}); err != nil {
		f.Close()
		return nil, err
	}
	n := newNotifier(f)
	go n.run()
	return n, nil
}

// run reads reports until the file is closed, or fails.
func (n *notifier) run() {
	defer close(n.done)
	// Room for many reports; one needs syscall.SizeofInotifyEvent bytes and
	// a file name of up to 255 bytes, NUL-terminated and padded.
	buf := make([]byte, 64<<10)
	for {
		k, err := n.f.Read(buf)
		if err != nil {
			n.fail() // closed, or broken
			return
		}
		n.parse(buf[:k])
	}
}

// parse records the reports in b, which holds whole struct inotify_event
// records: wd, mask, cookie and len, each 32 bits in the host's byte order,
// then len bytes of NUL-padded file name.
func (n *notifier) parse(b []byte) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for len(b) >= syscall.SizeofInotifyEvent {
		mask := binary.NativeEndian.Uint32(b[4:])
		size := syscall.SizeofInotifyEvent + int(binary.NativeEndian.Uint32(b[12:]))
		if size > len(b) {
			break // cannot happen: the kernel returns whole records
		}
		file := string(b[syscall.SizeofInotifyEvent:size])
		if i := strings.IndexByte(file, 0); i >= 0 {
			file = file[:i]
		}
		b = b[size:]

		switch {
		case mask&syscall.IN_Q_OVERFLOW != 0:
			n.lost = true
		case mask&(syscall.IN_IGNORED|syscall.IN_UNMOUNT|syscall.IN_DELETE_SELF|syscall.IN_MOVE_SELF) != 0:
			n.failed = true // the watch is gone, or watches what is not the directory any more
		case mask&syscall.IN_ISDIR != 0:
			continue // not one of the Store's files
		default:
			// A name's files are named by its encoding, which has no '.',
			// and a suffix.
			i := strings.IndexByte(file, '.')
			if i <= 0 {
				continue
			}
			switch file[i:] {
			case stateSuffix:
				n.hints[file[:i]] |= hintState
			case leaderLockSuffix:
				if mask&syscall.IN_CLOSE_WRITE != 0 {
					n.hints[file[:i]] |= hintLock
				}
			default:
				continue // the state lock, the temporary state, others' files
			}
		}
		n.signal()
	}
}
