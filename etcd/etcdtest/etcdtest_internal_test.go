//go:build unix

package etcdtest

import (
	"errors"
	"net"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"
)

func TestStartClusterReportsAPortInUse(t *testing.T) {
	t.Parallel()
	bin := Build(t)
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	ports, err := freePorts(5)
	if err != nil {
		t.Fatal(err)
	}
	// Member 1's peer port is taken.
	ports = append(ports[:3], append([]int{taken.Addr().(*net.TCPAddr).Port}, ports[3:]...)...)

	start := time.Now()
	c, err := startCluster(t, bin, config{heartbeat: 100 * time.Millisecond, election: time.Second}, ports)
	if err == nil {
		c.stop()
		t.Fatal("startCluster succeeded with a port taken")
	}
	if !errors.Is(err, errPortInUse) {
		t.Fatalf("startCluster with a port taken: got %v, want errPortInUse", err)
	}
	if elapsed := time.Since(start); elapsed > 10*time.Second {
		t.Errorf("startCluster took %v to report a port in use, want at once", elapsed)
	}
}

func TestWatchdogKillsPausedMembersAndRemovesTheDirectory(t *testing.T) {
	t.Parallel()
	bin := Build(t)
	dir := t.TempDir() + "/cluster"
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	w, err := startWatchdog(bin, dir)
	if err != nil {
		t.Fatal(err)
	}
	// Two paused processes, one watched, one watched then not.
	procs := make([]*exec.Cmd, 2)
	for i := range procs {
		procs[i] = exec.Command("sleep", "60")
		if err := procs[i].Start(); err != nil {
			t.Fatal(err)
		}
		defer procs[i].Process.Kill()
		procs[i].Process.Signal(syscall.SIGSTOP)
		w.watch(procs[i].Process.Pid)
	}
	w.unwatch(procs[1].Process.Pid)

	w.stop() // as when the test binary dies: its standard input closes
	state, err := procs[0].Process.Wait()
	if err != nil {
		t.Fatal(err)
	}
	if ws := state.Sys().(syscall.WaitStatus); !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Errorf("watched process: %v, want killed by SIGKILL", state)
	}
	if err := syscall.Kill(procs[1].Process.Pid, 0); err != nil {
		t.Errorf("unwatched process %d: %v, want it alive", procs[1].Process.Pid, err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("directory after the watchdog stopped: %v, want it removed", err)
	}
}
