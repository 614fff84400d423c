//go:build darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package supervise

import "syscall"

// becomeSubreaper does nothing: child subreapers are a Linux feature. The
// command's orphaned descendants are reparented to init (launchd on macOS),
// which reaps them; the supervisor still waits until the command's process
// group is empty, so nothing changes for processes that stay in the group.
func becomeSubreaper() error { return nil }

// commandAttr is how the supervisor starts the command: in a process group
// of its own. There is no parent-death signal here: if the supervisor is
// killed, the leader process kills the group when it sees the status pipe
// close (see Child.watch).
func commandAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true}
}
