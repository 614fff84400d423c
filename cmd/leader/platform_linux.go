package main

import (
	"os"
	"strconv"
	"strings"
	"syscall"
)

// demoCandidateAttr is how the demo starts its candidates: with a
// parent-death SIGTERM, tied to the thread that starts them (runDemo locks
// it), so that a demo killed without warning takes its candidates, and so
// their commands, along.
func demoCandidateAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
}

// pidAlive reports whether process pid runs: it exists and is not a zombie.
func pidAlive(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	s := string(b)
	if i := strings.LastIndexByte(s, ')'); i >= 0 && i+2 < len(s) {
		return s[i+2] != 'Z'
	}
	return true
}
