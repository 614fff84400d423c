package pgtest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// PgBouncer starts a PgBouncer in front of the database that connString
// names, in the given pool mode ("transaction", "session" or "statement"),
// and returns a connection string for the same database through it. It is
// stopped when t ends, and also when the test binary dies without ending t
// (a watchdog process, as for the clusters).
//
// PgBouncer listens on a free port of 127.0.0.1 and lets any client in
// without a password; it logs in to the server as the user, with the
// password, that connString names. A pool holds at most 4 server
// connections, so that clients share them.
//
// The returned connection string carries default_query_exec_mode=exec,
// which pgx reads: PgBouncer 1.18 does not support protocol-level prepared
// statements in transaction or statement mode, and pgx's default mode
// (cache_statement) relies on them. Only the host, port, user, password,
// database and whether to use TLS carry over from connString; other
// parameters (application_name, search_path, ...) do not.
//
// It fails t, naming the Debian package pgbouncer, if the pgbouncer binary
// is not installed (on PATH or at /usr/sbin/pgbouncer). When the test binary
// runs as root, PgBouncer runs as the "postgres" OS user, as it refuses to
// run as root.
func PgBouncer(t testing.TB, connString string, poolMode string) string {
	t.Helper()
	b, err := startPgBouncer(connString, poolMode)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := b.stop(); err != nil {
			t.Errorf("pgtest: stopping PgBouncer: %v", err)
		}
	})
	return b.connString
}

// pgBouncerPoolModes are the values of PgBouncer's pool_mode.
var pgBouncerPoolModes = []string{"session", "transaction", "statement"}

// pgBouncerSettings go into the [pgbouncer] section of pgbouncer.ini, after
// listen_port, auth_type and pool_mode:
//   - no Unix socket, so that instances never collide on one;
//   - a small pool, so that clients share server connections, as they do
//     behind a busy pooler;
//   - room for many clients, for tests that open a pgx pool or several;
//   - a short pause after a failed server login (15 s by default), for
//     tests that restart the server behind PgBouncer.
const pgBouncerSettings = `listen_addr = 127.0.0.1
unix_socket_dir =
default_pool_size = 4
max_client_conn = 200
server_login_retry = 1
`

// pgBouncerStopTimeout bounds the wait for PgBouncer to exit after SIGTERM,
// before it is killed.
const pgBouncerStopTimeout = 10 * time.Second

// pgBouncer is a running PgBouncer. Its process is a child of the test
// binary, in the foreground (not daemonized), so that it can be waited for.
type pgBouncer struct {
	dir        string // temporary; holds pgbouncer.ini and pgbouncer.log
	logFile    string
	connString string // through PgBouncer

	cmd     *exec.Cmd
	exited  chan struct{} // closed once cmd has been waited for
	waitErr error         // cmd.Wait's result; read after exited is closed

	// The watchdog stops PgBouncer and removes dir when its standard input,
	// a pipe from this process, closes while a process ID is armed (see
	// startWatchdog).
	watchdog     *exec.Cmd
	watchdogMu   sync.Mutex // serializes writes to watchdogPipe
	watchdogPipe *os.File   // write end

	stopOnce sync.Once
	stopErr  error
}

func startPgBouncer(connString, poolMode string) (*pgBouncer, error) {
	if !slices.Contains(pgBouncerPoolModes, poolMode) {
		return nil, fmt.Errorf("pgtest: PgBouncer pool mode %q: want one of %s", poolMode, strings.Join(pgBouncerPoolModes, ", "))
	}
	bin, err := findPgBouncer()
	if err != nil {
		return nil, err
	}
	cfg, err := pgx.ParseConfig(connString)
	if err != nil {
		return nil, fmt.Errorf("pgtest: PgBouncer: parsing connection string: %w", err)
	}
	database, err := pgBouncerDatabase(&cfg.Config)
	if err != nil {
		return nil, err
	}
	var cred *syscall.Credential
	if os.Geteuid() == 0 {
		if cred, err = osUserCredential("postgres"); err != nil {
			return nil, fmt.Errorf("pgtest: running as root, and PgBouncer refuses to run as root, but there is no OS user to run it as: %w", err)
		}
	}

	b := &pgBouncer{}
	b.dir, err = os.MkdirTemp("", "leader-pgbouncer-")
	if err != nil {
		return nil, fmt.Errorf("pgtest: %w", err)
	}
	b.logFile = filepath.Join(b.dir, "pgbouncer.log")
	if cred != nil {
		if err := os.Chown(b.dir, int(cred.Uid), int(cred.Gid)); err != nil {
			os.RemoveAll(b.dir)
			return nil, fmt.Errorf("pgtest: handing the PgBouncer directory to the postgres OS user: %w", err)
		}
	}
	if err := b.startWatchdog(); err != nil {
		os.RemoveAll(b.dir)
		return nil, err
	}
	if err := b.start(bin, database, &cfg.Config, poolMode, cred); err != nil {
		_ = b.stop() // err says what went wrong
		return nil, err
	}
	return b, nil
}

// start starts PgBouncer on a free port and waits until it serves a query.
// A port taken by someone else between choosing and binding it is replaced,
// twice at most.
func (b *pgBouncer) start(bin, database string, cfg *pgconn.Config, poolMode string, cred *syscall.Credential) error {
	for attempt := 1; ; attempt++ {
		port, err := freePort()
		if err != nil {
			return err
		}
		ini := fmt.Sprintf("[databases]\n%s\n\n[pgbouncer]\nlisten_port = %d\nauth_type = any\npool_mode = %s\nserver_tls_sslmode = %s\n%s",
			database, port, poolMode, pgBouncerServerTLS(cfg), pgBouncerSettings)
		iniFile := filepath.Join(b.dir, "pgbouncer.ini")
		if err := writeFileFor(iniFile, ini, cred); err != nil {
			return err
		}
		// auth_type any ignores the client's user name, but pgx needs one.
		u := url.URL{
			Scheme:   "postgres",
			User:     url.User(cfg.User),
			Host:     net.JoinHostPort("127.0.0.1", strconv.Itoa(port)),
			Path:     "/" + cfg.Database,
			RawQuery: "sslmode=disable&default_query_exec_mode=exec",
		}
		b.connString = u.String()

		if err := b.startProcess(bin, iniFile, cred); err != nil {
			return err
		}
		err = b.waitReady(time.Now().Add(30 * time.Second))
		if err == nil {
			return nil
		}
		log := b.logTail()
		if attempt < 3 && b.hasExited() && strings.Contains(log, "Address already in use") {
			continue
		}
		return fmt.Errorf("pgtest: PgBouncer (%s, port %d): %w\nPgBouncer log:\n%s", bin, port, err, log)
	}
}

// startProcess starts PgBouncer as a child process, its output going to
// the log file, and arms the watchdog with its process ID.
func (b *pgBouncer) startProcess(bin, iniFile string, cred *syscall.Credential) error {
	log, err := os.OpenFile(b.logFile, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("pgtest: PgBouncer log: %w", err)
	}
	defer log.Close()
	cmd := exec.Command(bin, iniFile)
	cmd.Dir = b.dir
	cmd.Stdout = log
	cmd.Stderr = log
	// Own process group: a Ctrl-C meant for the tests does not reach it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred, Setpgid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("pgtest: starting %s: %w", bin, err)
	}
	b.cmd = cmd
	b.exited = make(chan struct{})
	b.tellWatchdog(strconv.Itoa(cmd.Process.Pid))
	go func() {
		err := cmd.Wait()
		// Disarm before anything else: the process ID may now be reused.
		b.tellWatchdog("")
		b.waitErr = err
		close(b.exited)
	}()
	return nil
}

// waitReady waits until a query through PgBouncer succeeds. It gives up at
// the deadline, when PgBouncer exits, or when PgBouncer answers with an
// error (such as a failed login to the server), which waiting does not fix.
func (b *pgBouncer) waitReady(deadline time.Time) error {
	for {
		if b.hasExited() {
			return fmt.Errorf("exited while starting: %v", b.waitErr)
		}
		err := b.probe()
		if err == nil {
			return nil
		}
		if pgErr := (*pgconn.PgError)(nil); errors.As(err, &pgErr) {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no answer before the deadline: %w", err)
		}
		select {
		case <-b.exited:
		case <-time.After(20 * time.Millisecond): // poll interval
		}
	}
}

func (b *pgBouncer) probe() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, b.connString)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	var one int
	return conn.QueryRow(ctx, "SELECT 1").Scan(&one)
}

func (b *pgBouncer) hasExited() bool {
	select {
	case <-b.exited:
		return true
	default:
		return false
	}
}

// stop stops PgBouncer (SIGTERM, then SIGKILL after pgBouncerStopTimeout),
// waits for it and its watchdog, and removes its files. It reports an error
// if PgBouncer had exited on its own before. Later calls return the first
// call's result.
func (b *pgBouncer) stop() error {
	b.stopOnce.Do(func() { b.stopErr = b.doStop() })
	return b.stopErr
}

func (b *pgBouncer) doStop() error {
	var err error
	if b.cmd != nil {
		if b.hasExited() {
			err = fmt.Errorf("pgtest: PgBouncer exited before it was stopped: %v\nPgBouncer log:\n%s", b.waitErr, b.logTail())
		} else {
			// PgBouncer 1.18 shuts down at once on SIGTERM.
			_ = b.cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-b.exited:
			case <-time.After(pgBouncerStopTimeout):
				_ = b.cmd.Process.Kill()
				<-b.exited
				err = fmt.Errorf("pgtest: PgBouncer did not exit within %v of SIGTERM and was killed\nPgBouncer log:\n%s", pgBouncerStopTimeout, b.logTail())
			}
		}
	}
	// Disarmed since PgBouncer was waited for: the watchdog just removes
	// the directory.
	b.watchdogMu.Lock()
	b.watchdogPipe.Close()
	b.watchdogPipe = nil
	b.watchdogMu.Unlock()
	if werr := b.watchdog.Wait(); werr != nil {
		err = errors.Join(err, fmt.Errorf("pgtest: PgBouncer watchdog: %w", werr))
	}
	if rerr := os.RemoveAll(b.dir); rerr != nil {
		err = errors.Join(err, fmt.Errorf("pgtest: removing %s: %w", b.dir, rerr))
	}
	return err
}

// startWatchdog starts a shell that reads lines from a pipe from this
// process: a process ID arms it, an empty line disarms it. When the pipe
// closes, because this process closed it (stop) or died in any way, the
// shell sends SIGTERM to the armed process, if any, and removes the
// directory, so that no PgBouncer outlives the tests. It runs as this
// process's user, who may signal PgBouncer either way.
func (b *pgBouncer) startWatchdog() error {
	r, w, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("pgtest: PgBouncer watchdog pipe: %w", err)
	}
	defer r.Close()
	const script = `pid= ; while read -r line ; do pid=$line ; done ; if [ -n "$pid" ] ; then kill -TERM "$pid" 2>/dev/null ; fi ; rm -rf "$1"`
	cmd := exec.Command("/bin/sh", "-c", script, "pgtest-pgbouncer-watchdog", b.dir)
	cmd.Stdin = r
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		w.Close()
		return fmt.Errorf("pgtest: starting PgBouncer watchdog: %w", err)
	}
	b.watchdog, b.watchdogPipe = cmd, w
	return nil
}

// tellWatchdog sends the watchdog one line. A failed write is not reported
// here: the watchdog has died, which stop reports.
func (b *pgBouncer) tellWatchdog(line string) {
	b.watchdogMu.Lock()
	defer b.watchdogMu.Unlock()
	if b.watchdogPipe != nil {
		_, _ = b.watchdogPipe.WriteString(line + "\n")
	}
}

func (b *pgBouncer) logTail() string {
	data, err := os.ReadFile(b.logFile)
	if err != nil {
		return "(no PgBouncer log: " + err.Error() + ")"
	}
	if len(data) > 4000 {
		data = data[len(data)-4000:]
	}
	return string(bytes.TrimSpace(data))
}

// pgBouncerDatabase returns the [databases] line for the database that cfg
// names: PgBouncer logs in to it as cfg's user, with cfg's password, so the
// clients need none (auth_type any). The client-side name is the database's
// own name.
func pgBouncerDatabase(cfg *pgconn.Config) (string, error) {
	if cfg.Database == "" {
		return "", errors.New("pgtest: PgBouncer: the connection string names no database")
	}
	if cfg.User == "" {
		return "", errors.New("pgtest: PgBouncer: the connection string names no user")
	}
	var b strings.Builder
	b.WriteString(pgBouncerName(cfg.Database))
	b.WriteString(" =")
	for _, kv := range [][2]string{
		{"host", cfg.Host},
		{"port", strconv.Itoa(int(cfg.Port))},
		{"user", cfg.User},
		{"password", cfg.Password},
		{"dbname", cfg.Database},
	} {
		if kv[1] == "" {
			continue // PgBouncer refuses empty values
		}
		if strings.ContainsAny(kv[1], "\r\n\x00") {
			return "", fmt.Errorf("pgtest: PgBouncer: the connection string's %s has a line break or NUL, which pgbouncer.ini cannot hold", kv[0])
		}
		b.WriteString(" " + kv[0] + "='" + strings.ReplaceAll(kv[1], "'", "''") + "'")
	}
	return b.String(), nil
}

var plainPgBouncerName = regexp.MustCompile(`^[0-9A-Za-z_]+$`)

// pgBouncerName quotes a database name for the key of a [databases] line,
// as an SQL identifier, if it needs it.
func pgBouncerName(name string) string {
	if plainPgBouncerName.MatchString(name) {
		return name
	}
	return `"` + strings.ReplaceAll(name, `"`, `""`) + `"`
}

// pgBouncerServerTLS returns PgBouncer's server_tls_sslmode for what cfg
// asks of TLS. Certificates are not checked: PgBouncer would need their
// files, and tests do not need them checked.
func pgBouncerServerTLS(cfg *pgconn.Config) string {
	if cfg.TLSConfig == nil {
		return "disable"
	}
	for _, fb := range cfg.Fallbacks {
		if fb.Host == cfg.Host && fb.Port == cfg.Port && fb.TLSConfig == nil {
			return "prefer"
		}
	}
	return "require"
}

// writeFileFor writes a file readable only by its owner: the OS user cred
// names, or this process's user when cred is nil.
func writeFileFor(name, content string, cred *syscall.Credential) error {
	err := os.WriteFile(name, []byte(content), 0o600)
	if err == nil && cred != nil {
		err = os.Chown(name, int(cred.Uid), int(cred.Gid))
	}
	if err != nil {
		return fmt.Errorf("pgtest: writing %s: %w", name, err)
	}
	return nil
}

// osUserCredential returns the credential that runs a child process as the
// OS user name.
func osUserCredential(name string) (*syscall.Credential, error) {
	u, err := user.Lookup(name)
	if err != nil {
		return nil, err
	}
	uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
	gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
	if err := errors.Join(err1, err2); err != nil {
		return nil, fmt.Errorf("OS user %s: %w", name, err)
	}
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
}

// findPgBouncer finds the pgbouncer binary: on PATH, then at
// /usr/sbin/pgbouncer (Debian's place, often not on a user's PATH).
func findPgBouncer() (string, error) { return findPgBouncerIn("/usr/sbin/pgbouncer") }

// findPgBouncerIn is findPgBouncer with the place to look after PATH as a
// parameter.
func findPgBouncerIn(fallback string) (string, error) {
	if p, err := exec.LookPath("pgbouncer"); err == nil {
		return p, nil
	}
	if fi, err := os.Stat(fallback); err == nil && !fi.IsDir() && fi.Mode()&0o111 != 0 {
		return fallback, nil
	}
	return "", fmt.Errorf("pgtest: no pgbouncer binary found on PATH or at %s; install PgBouncer (Debian: apt-get install pgbouncer)", fallback)
}
