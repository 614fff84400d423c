package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"
)

// proc is a child process of the bench binary.
type proc struct {
	cmd    *exec.Cmd
	mu     sync.Mutex // serializes writes to stdin
	stdin  io.WriteCloser
	exited chan struct{} // closed once the process has exited and been reaped
}

// procs are the live children, so that none outlives the bench: they are
// killed when it returns, panics or is interrupted, and each one is also
// set to receive SIGKILL if the bench dies (Pdeathsig), and exits when its
// standard input closes.
type procs struct {
	mu   sync.Mutex
	live map[*proc]struct{}
	log  *os.File // the children's standard error
	exe  string
}

func newProcs(log *os.File) (*procs, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	return &procs{live: map[*proc]struct{}{}, log: log, exe: exe}, nil
}

// start runs the bench binary as a child with role and spec. It returns
// the child and its events; the channel is closed when its standard
// output ends (the child has exited or is about to).
func (ps *procs) start(role string, spec childSpec) (*proc, <-chan event, error) {
	js, err := json.Marshal(spec)
	if err != nil {
		return nil, nil, err
	}
	cmd := exec.Command(ps.exe)
	cmd.Env = append(os.Environ(), envRole+"="+role, envSpec+"="+string(js))
	cmd.Stderr = ps.log
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, nil, err
	}
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if ps.live == nil {
		return nil, nil, fmt.Errorf("the bench is shutting down")
	}
	if err := cmd.Start(); err != nil {
		return nil, nil, err
	}
	p := &proc{cmd: cmd, stdin: stdin, exited: make(chan struct{})}
	ps.live[p] = struct{}{}
	events := make(chan event, 256)
	go func() {
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			var ev event
			if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
				fmt.Fprintf(ps.log, "bench: child %d wrote %q\n", cmd.Process.Pid, sc.Text())
				continue
			}
			events <- ev
		}
		close(events)
		cmd.Wait()
		ps.mu.Lock()
		delete(ps.live, p)
		ps.mu.Unlock()
		close(p.exited)
	}()
	return p, events, nil
}

func (p *proc) pid() int { return p.cmd.Process.Pid }

// send writes a command line to the child; a child that has gone is not
// an error.
func (p *proc) send(cmd string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	_, _ = io.WriteString(p.stdin, cmd+"\n")
}

func (p *proc) kill() { _ = p.cmd.Process.Signal(syscall.SIGKILL) }

// stop asks the child to exit and kills it if it has not within grace.
func (p *proc) stop(grace time.Duration) {
	p.send(cmdExit)
	select {
	case <-p.exited:
	case <-time.After(grace):
		p.kill()
		<-p.exited
	}
}

// killAll kills every live child, and refuses new ones.
func (ps *procs) killAll() {
	ps.mu.Lock()
	live := ps.live
	ps.live = nil
	ps.mu.Unlock()
	for p := range live {
		p.kill()
	}
	for p := range live {
		select {
		case <-p.exited:
		case <-time.After(5 * time.Second):
		}
	}
}
