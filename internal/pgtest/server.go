package pgtest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// localServer is a throwaway cluster run from the installed binaries.
type localServer struct {
	binDir  string
	rootDir string // temporary; holds data/, the socket and server.log
	dataDir string
	logFile string
	cred    *syscall.Credential // the server's OS user when we run as root; nil otherwise

	watchdog     *exec.Cmd
	watchdogPipe *os.File // write end; closing it makes the watchdog clean up

	mu      sync.Mutex
	port    int
	running bool
	closed  bool
}

// serverSettings go into postgresql.conf. The server is reachable on
// 127.0.0.1 only; durability is traded for speed, as the data is thrown away.
const serverSettings = `
listen_addresses = '127.0.0.1'
unix_socket_directories = '%s'
fsync = off
synchronous_commit = off
full_page_writes = off
max_connections = 300
log_min_messages = warning
log_connections = off
`

// startServer starts a throwaway cluster: a fresh data directory made by
// initdb, with serverSettings in postgresql.conf.
func startServer() (*localServer, error) {
	s, err := newLocalServer()
	if err != nil {
		return nil, err
	}
	if err := s.initdb(); err != nil {
		return nil, errors.Join(err, s.close())
	}
	if err := s.start(); err != nil {
		return nil, errors.Join(err, s.close())
	}
	return s, nil
}

// newLocalServer prepares a throwaway cluster without a data directory: it
// finds the binaries, makes the temporary directory (owned by the server's
// OS user) and starts the watchdog. Its caller makes the data directory
// (initdb, or pg_basebackup for a standby) and starts the server; on
// failure it calls close.
func newLocalServer() (*localServer, error) {
	binDir, err := findBinDir()
	if err != nil {
		return nil, err
	}
	s := &localServer{binDir: binDir}
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			return nil, fmt.Errorf("pgtest: running as root, and PostgreSQL refuses to run as root, but there is no \"postgres\" OS user to run it as: %w", err)
		}
		uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
		gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
		if err := errors.Join(err1, err2); err != nil {
			return nil, fmt.Errorf("pgtest: OS user postgres: %w", err)
		}
		s.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
	}

	s.rootDir, err = os.MkdirTemp("", "leader-pgtest-")
	if err != nil {
		return nil, fmt.Errorf("pgtest: %w", err)
	}
	if s.cred != nil {
		if err := os.Chown(s.rootDir, int(s.cred.Uid), int(s.cred.Gid)); err != nil {
			os.RemoveAll(s.rootDir)
			return nil, fmt.Errorf("pgtest: handing the temporary directory to the postgres OS user: %w", err)
		}
	}
	s.dataDir = filepath.Join(s.rootDir, "data")
	s.logFile = filepath.Join(s.rootDir, "server.log")

	if err := s.startWatchdog(); err != nil {
		os.RemoveAll(s.rootDir)
		return nil, err
	}
	return s, nil
}

// startWatchdog starts a shell that waits for its standard input, a pipe
// from this process, to close. That happens when this process closes it
// (close) or dies in any way; the shell then stops the server and removes
// its files, so no server outlives the tests.
func (s *localServer) startWatchdog() error {
	r, w, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("pgtest: watchdog pipe: %w", err)
	}
	defer r.Close()
	const script = `read _ ; "$0" stop -D "$1" -m immediate -s >/dev/null 2>&1 ; rm -rf "$2"`
	cmd := exec.Command("/bin/sh", "-c", script, filepath.Join(s.binDir, "pg_ctl"), s.dataDir, s.rootDir)
	cmd.Stdin = r
	cmd.Env = s.env()
	cmd.SysProcAttr = s.procAttr()
	if err := cmd.Start(); err != nil {
		w.Close()
		return fmt.Errorf("pgtest: starting watchdog: %w", err)
	}
	s.watchdog, s.watchdogPipe = cmd, w
	return nil
}

func (s *localServer) initdb() error {
	out, err := s.run(2*time.Minute, "initdb", "-D", s.dataDir, "-U", "postgres", "-A", "trust",
		"-E", "UTF8", "--locale=C", "--no-sync", "--no-instructions")
	if err != nil {
		return fmt.Errorf("pgtest: initdb in %s: %w\n%s", s.binDir, err, out)
	}
	return s.appendToFile("postgresql.conf", fmt.Sprintf(serverSettings, s.rootDir))
}

// appendToFile appends text to one of the files of the data directory
// (postgresql.conf, pg_hba.conf). The server reads it at its next start or
// reload.
func (s *localServer) appendToFile(name, text string) error {
	f, err := os.OpenFile(filepath.Join(s.dataDir, name), os.O_APPEND|os.O_WRONLY, 0)
	if err == nil {
		_, err = f.WriteString(text)
		err = errors.Join(err, f.Close())
	}
	if err != nil {
		return fmt.Errorf("pgtest: writing %s: %w", name, err)
	}
	return nil
}

// start starts the server and waits until it accepts connections. The first
// start picks a free port; later ones reuse it so that clients reconnect to
// the same address. A port taken in the meantime by someone else is replaced
// on the first start only.
func (s *localServer) start() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return errors.New("pgtest: cluster already closed")
	}
	if s.running {
		return nil
	}
	firstStart := s.port == 0
	for attempt := 1; ; attempt++ {
		if firstStart {
			port, err := freePort()
			if err != nil {
				return err
			}
			s.port = port
		}
		out, err := s.run(2*time.Minute, "pg_ctl", "start", "-D", s.dataDir, "-w", "-t", "60", "-s",
			"-l", s.logFile, "-o", "-p "+strconv.Itoa(s.port))
		if err == nil {
			s.running = true
			return nil
		}
		log := s.logTail()
		if firstStart && attempt < 3 && strings.Contains(log, "could not bind") {
			continue
		}
		return fmt.Errorf("pgtest: pg_ctl start (%s, port %d): %w\n%s\nserver log:\n%s", s.binDir, s.port, err, out, log)
	}
}

// stop shuts the server down with mode "fast" or "immediate".
func (s *localServer) stop(mode string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.running {
		return nil
	}
	out, err := s.run(2*time.Minute, "pg_ctl", "stop", "-D", s.dataDir, "-m", mode, "-w", "-t", "60", "-s")
	if err != nil {
		return fmt.Errorf("pgtest: pg_ctl stop -m %s: %w\n%s", mode, err, out)
	}
	s.running = false
	return nil
}

// kill kills the postmaster with SIGKILL and waits until every process
// whose working directory is the data directory (the postmaster chdirs
// there, and its children inherit it) has exited.
func (s *localServer) kill() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.running {
		return nil
	}
	dataDir, err := filepath.EvalSymlinks(s.dataDir)
	if err != nil {
		return fmt.Errorf("pgtest: kill: %w", err)
	}
	if _, err := os.Readlink("/proc/self/cwd"); err != nil {
		return fmt.Errorf("pgtest: kill needs /proc to find the server's processes: %w", err)
	}
	b, err := os.ReadFile(filepath.Join(s.dataDir, "postmaster.pid"))
	if err != nil {
		return fmt.Errorf("pgtest: kill: reading the postmaster's PID: %w", err)
	}
	first, _, _ := strings.Cut(string(b), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(first))
	if err != nil || pid <= 0 {
		return fmt.Errorf("pgtest: kill: postmaster.pid starts with %q, not a PID", first)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		return fmt.Errorf("pgtest: kill -KILL %d (the postmaster): %w", pid, err)
	}
	s.running = false
	deadline := time.Now().Add(time.Minute)
	for {
		// A dying process leaves its working directory before it becomes
		// a zombie: wait for the postmaster itself to be dead too.
		left := processesIn(dataDir)
		if len(left) == 0 && (isZombie(pid) || !exists(pid)) {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("pgtest: a minute after the postmaster (PID %d) was killed, processes %v still run in %s", pid, left, dataDir)
		}
		time.Sleep(10 * time.Millisecond) // poll interval
	}
	// The dead postmaster stays a zombie until its parent, init, reaps it,
	// which some containers' inits do late or never; its lock files name
	// it, and a zombie answers kill(pid, 0), so the next postmaster would
	// take it for a live one and refuse to start. It is dead: remove them.
	if isZombie(pid) {
		for _, f := range []string{filepath.Join(s.dataDir, "postmaster.pid"), filepath.Join(s.rootDir, fmt.Sprintf(".s.PGSQL.%d.lock", s.port))} {
			if err := os.Remove(f); err != nil && !os.IsNotExist(err) {
				return fmt.Errorf("pgtest: kill: removing the dead postmaster's lock file: %w", err)
			}
		}
	}
	return nil
}

// exists reports whether process pid exists, as a zombie or not.
func exists(pid int) bool {
	_, err := os.Stat(filepath.Join("/proc", strconv.Itoa(pid)))
	return err == nil
}

// isZombie reports whether process pid has exited but not been reaped.
func isZombie(pid int) bool {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return false
	}
	// The state follows the command name, which is in parentheses and may
	// itself contain them.
	_, after, ok := strings.Cut(string(b[bytes.LastIndexByte(b, ')')+1:]), " ")
	return ok && strings.HasPrefix(after, "Z")
}

// processesIn returns the PIDs of the live processes whose working
// directory is dir. A zombie has no working directory, and has released
// its memory, so it is not counted.
func processesIn(dir string) []int {
	entries, _ := os.ReadDir("/proc")
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if cwd, err := os.Readlink(filepath.Join("/proc", e.Name(), "cwd")); err == nil && cwd == dir {
			pids = append(pids, pid)
		}
	}
	return pids
}

// close stops the server at once and removes its files.
func (s *localServer) close() error {
	err := s.stop("immediate")
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	if s.watchdog != nil {
		s.watchdogPipe.Close()
		if werr := s.watchdog.Wait(); werr != nil {
			err = errors.Join(err, fmt.Errorf("pgtest: watchdog: %w", werr))
		}
		s.watchdog = nil
	}
	if rerr := os.RemoveAll(s.rootDir); rerr != nil {
		err = errors.Join(err, fmt.Errorf("pgtest: removing %s: %w", s.rootDir, rerr))
	}
	return err
}

func (s *localServer) addr() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port))
}

func (s *localServer) connString(database string) string {
	return "postgres://postgres@" + s.addr() + "/" + database + "?sslmode=disable"
}

// run runs one of the server binaries as the server's OS user. Its output goes
// to a file rather than a pipe, because pg_ctl start leaves the server
// running with whatever pg_ctl had as output, and a pipe would then never
// reach end of file.
func (s *localServer) run(timeout time.Duration, name string, args ...string) (string, error) {
	out, err := os.CreateTemp("", "leader-pgtest-out-")
	if err != nil {
		return "", fmt.Errorf("pgtest: %w", err)
	}
	defer os.Remove(out.Name())
	defer out.Close()

	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(s.binDir, name), args...)
	cmd.Dir = s.rootDir
	cmd.Env = s.env()
	cmd.Stdout = out
	cmd.Stderr = out
	cmd.SysProcAttr = s.procAttr()
	runErr := cmd.Run()
	b, _ := os.ReadFile(out.Name())
	return strings.TrimSpace(string(b)), runErr
}

// procAttr runs children as the server's OS user, in their own process
// group so that a Ctrl-C meant for the tests does not reach the watchdog
// before it has cleaned up.
func (s *localServer) procAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Credential: s.cred, Setpgid: true}
}

// env is this process's environment without the PG* variables, which would
// otherwise steer pg_ctl and initdb.
func (s *localServer) env() []string {
	env := slices.DeleteFunc(os.Environ(), func(kv string) bool { return strings.HasPrefix(kv, "PG") })
	return append(env, "LC_ALL=C")
}

func (s *localServer) logTail() string {
	b, err := os.ReadFile(s.logFile)
	if err != nil {
		return "(no server log: " + err.Error() + ")"
	}
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(bytes.TrimSpace(b))
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("pgtest: finding a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// serverBinaries are the programs a throwaway cluster needs, all in one
// directory (pg_ctl runs the postgres found beside it).
var serverBinaries = []string{"initdb", "pg_ctl", "postgres"}

// findBinDir finds the directory of the server binaries: initdb on PATH,
// then pg_config --bindir, then the newest /usr/lib/postgresql/*/bin.
func findBinDir() (string, error) { return findBinDirIn("/usr/lib/postgresql/*/bin") }

// findBinDirIn is findBinDir with the last place to look, a glob whose
// second-to-last element is a version, as a parameter.
func findBinDirIn(versionGlob string) (string, error) {
	var looked []string
	if p, err := exec.LookPath("initdb"); err == nil {
		if resolved, err := filepath.EvalSymlinks(p); err == nil {
			p = resolved
		}
		dir := filepath.Dir(p)
		if hasServerBinaries(dir) {
			return dir, nil
		}
		looked = append(looked, dir+" (initdb on PATH, without pg_ctl or postgres beside it)")
	} else {
		looked = append(looked, "PATH")
	}
	if pgConfig, err := exec.LookPath("pg_config"); err == nil {
		out, err := exec.Command(pgConfig, "--bindir").Output()
		dir := strings.TrimSpace(string(out))
		if err == nil && hasServerBinaries(dir) {
			return dir, nil
		}
		looked = append(looked, fmt.Sprintf("%q (pg_config --bindir)", dir))
	} else {
		looked = append(looked, "pg_config --bindir (no pg_config on PATH)")
	}
	dirs, _ := filepath.Glob(versionGlob)
	slices.SortFunc(dirs, func(a, b string) int { return slices.Compare(versionOf(b), versionOf(a)) })
	for _, dir := range dirs {
		if hasServerBinaries(dir) {
			return dir, nil
		}
	}
	looked = append(looked, versionGlob)
	return "", fmt.Errorf("pgtest: no PostgreSQL server binaries (%s) found; looked in: %s. Install the server (Debian: apt-get install postgresql) or set %s to a server's connection string",
		strings.Join(serverBinaries, ", "), strings.Join(looked, "; "), EnvDatabaseURL)
}

func hasServerBinaries(dir string) bool {
	for _, name := range serverBinaries {
		fi, err := os.Stat(filepath.Join(dir, name))
		if err != nil || fi.IsDir() || fi.Mode()&0o111 == 0 {
			return false
		}
	}
	return true
}

// versionOf returns the numeric parts of the version directory in
// /usr/lib/postgresql/VERSION/bin ("9.6" -> [9 6]).
func versionOf(binDir string) []int {
	var v []int
	for _, part := range strings.Split(filepath.Base(filepath.Dir(binDir)), ".") {
		n, err := strconv.Atoi(part)
		if err != nil {
			return nil
		}
		v = append(v, n)
	}
	return v
}
