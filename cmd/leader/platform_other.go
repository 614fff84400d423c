//go:build darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"errors"
	"syscall"
)

// demoCandidateAttr is how the demo starts its candidates. There is no
// parent-death signal outside Linux: a demo killed without warning leaves
// its candidates running until they next write to its closed output pipes
// (SIGPIPE ends them then).
func demoCandidateAttr() *syscall.SysProcAttr { return nil }

// pidAlive reports whether process pid exists, by kill(pid, 0). Without
// /proc there is no cheap way to tell a zombie apart, so a zombie (exited,
// not yet reaped) counts as alive here. The pids checked are commands that
// their supervisor reaps at once.
func pidAlive(pid int) bool {
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}
