package supervise

import "syscall"

// prSetChildSubreaper is PR_SET_CHILD_SUBREAPER from <linux/prctl.h>.
const prSetChildSubreaper = 36

// becomeSubreaper makes the supervisor a child subreaper, so that the
// command's orphaned descendants are reparented to it (and reaped by it)
// rather than to init.
func becomeSubreaper() error {
	if _, _, errno := syscall.RawSyscall(syscall.SYS_PRCTL, prSetChildSubreaper, 1, 0); errno != 0 {
		return errno
	}
	return nil
}

// commandAttr is how the supervisor starts the command: in a process group
// of its own, with a parent-death SIGKILL tied to the supervisor's thread
// that forks it (see Main), so the command dies if the supervisor is killed.
func commandAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}
