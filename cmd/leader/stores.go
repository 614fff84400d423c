//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/url"
	"path/filepath"
	"strings"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/cmd/leader/internal/fence"
	"github.com/leaderelect/leader/cmd/leader/internal/redact"
	"github.com/leaderelect/leader/filelock"
)

// Strategies on PostgreSQL (--strategy). An election is elected with one
// of them at a time, which the store records and enforces (see
// postgres.StrategyConflictError): "leader run" is told its strategy, and
// status and watch find it from the store.
const (
	strategyLease    = "lease"    // postgres.LeaseStore: a row whose lease runs out
	strategyAdvisory = "advisory" // postgres.AdvisoryStore: a session advisory lock
)

// registerStrategy adds --strategy to fs, bound to p, with usage as its
// help.
func registerStrategy(fs *flag.FlagSet, p *string, usage string) {
	fs.StringVar(p, "strategy", strategyLease, usage)
}

// defaultStoreDir is the embedded store's directory in the per-user state
// directory: filelock.DefaultDir, which survives reboots (so terms keep
// growing across them). Only the message for a missing store offers it: no
// subcommand uses it unasked. With neither $XDG_STATE_HOME nor a home
// directory there is none; it is never in a temporary directory, where
// instances with different TMPDIRs or a private /tmp would each elect a
// leader of their own.
func defaultStoreDir() (string, error) {
	return filelock.DefaultDir()
}

// storeKind tells the backends apart.
type storeKind int

const (
	fileStore storeKind = iota
	postgresStore
	etcdStore
)

// openedStore is a store named by URL, ready for use.
type openedStore struct {
	leader.Store
	kind storeKind
	// strategy is the PostgreSQL strategy ("" for the other stores).
	strategy string
	// display is the URL as shown to people: passwords masked.
	display string
	// id names the store without secrets, for fences: the directory (its
	// symlinks resolved), or host, port and database.
	id string
	// fenceDir holds the store's fences (see package fence): next to the
	// embedded store, in a fixed per-user directory of the host for
	// PostgreSQL.
	fenceDir string
	// migrate creates or updates the store's schema (PostgreSQL only;
	// the other stores have none).
	migrate func(ctx context.Context) error
	// strategyOf returns the PostgreSQL strategy that the store records
	// for election name, "" for a name never elected (nil for the
	// other stores, which have no strategies).
	strategyOf func(ctx context.Context, name string) (string, error)
	close      func()
}

// fencePath returns the fence of election name on this store.
func (s *openedStore) fencePath(name string) string {
	return fence.Path(s.fenceDir, s.id, name)
}

func (s *openedStore) Close() {
	if s.close != nil {
		s.close()
	}
}

// storeSpec is a parsed store URL.
type storeSpec struct {
	kind     storeKind
	raw      string // as given (may hold a password: never print it)
	display  string
	dir      string    // fileStore
	strategy string    // postgresStore: strategyLease or strategyAdvisory; see withStrategy
	etcd     *etcdSpec // etcdStore
	// election, when set (status and watch), has a PostgreSQL store opened
	// with the strategy the store records for this election, and with
	// strategy only for an election never elected.
	election string
}

// parseStoreURL checks a store URL without opening anything.
func parseStoreURL(raw string) (storeSpec, error) {
	if raw == "" {
		return storeSpec{}, usagef("--store is empty")
	}
	display := redact.URL(raw)
	scheme, _, ok := strings.Cut(raw, "://")
	if !ok {
		return storeSpec{}, usagef("--store %s: want a URL: postgres://…, postgresql://…, etcd://…, etcds://… or file:///dir", display)
	}
	switch strings.ToLower(scheme) {
	case "postgres", "postgresql":
		return storeSpec{kind: postgresStore, raw: raw, display: display}, nil
	case "etcd", "etcds":
		es, err := parseEtcdURL(raw, display)
		if err != nil {
			return storeSpec{}, err
		}
		return storeSpec{kind: etcdStore, raw: raw, display: display, etcd: &es}, nil
	case "file":
		u, err := url.Parse(raw)
		if err != nil {
			return storeSpec{}, usagef("--store %s: %v", display, err)
		}
		if u.Host != "" && u.Host != "localhost" {
			return storeSpec{}, usagef("--store %s: a file URL names a local directory: file:///path (three slashes)", display)
		}
		if u.Path == "" || !filepath.IsAbs(u.Path) {
			return storeSpec{}, usagef("--store %s: want an absolute directory: file:///path", display)
		}
		dir := filepath.Clean(u.Path)
		if dir == string(filepath.Separator) {
			// The store writes files of its own beside each name's.
			return storeSpec{}, usagef("--store %s: the embedded store needs a directory of its own, not the root directory: file:///path", display)
		}
		return storeSpec{kind: fileStore, dir: dir, raw: raw, display: display}, nil
	default:
		return storeSpec{}, usagef("--store %s: unknown scheme %q; want postgres://…, postgresql://…, etcd://…, etcds://… or file:///dir", display, scheme)
	}
}

// scope says which instances elect one leader on this store, for the log.
func (s storeSpec) scope() string {
	switch s.kind {
	case fileStore:
		return "this host only (embedded store in " + s.dir + ")"
	case etcdStore:
		return "every host that reaches this etcd cluster"
	}
	return "every host that reaches this database"
}

// withStrategy returns spec with the strategy --strategy names, or a usage
// error. The embedded store has no strategies: any --strategy but the
// default is refused there.
func withStrategy(spec storeSpec, strategy string) (storeSpec, error) {
	switch {
	case strategy != "" && strategy != strategyLease && spec.kind != postgresStore:
		return spec, usagef("--strategy applies to PostgreSQL stores only")
	case spec.kind != postgresStore:
		return spec, nil
	}
	switch strategy {
	case "", strategyLease:
		spec.strategy = strategyLease
	case strategyAdvisory:
		spec.strategy = strategyAdvisory
	default:
		return spec, usagef("--strategy %q: want lease or advisory", strategy)
	}
	return spec, nil
}

// openStore opens the store spec names.
func openStore(ctx context.Context, spec storeSpec, log *slog.Logger) (*openedStore, error) {
	return openStoreFor(ctx, spec, log, false)
}

// openStoreFor opens the store; forMigrate skips the check that a
// PostgreSQL schema exists.
func openStoreFor(ctx context.Context, spec storeSpec, log *slog.Logger, forMigrate bool) (*openedStore, error) {
	switch spec.kind {
	case fileStore:
		fs, err := filelock.Open(spec.dir)
		if err != nil {
			return nil, fmt.Errorf("opening the embedded store in %s: %w", spec.dir, err)
		}
		// One directory, however it is named: through a symlink or not.
		dir, err := filepath.EvalSymlinks(fs.Dir())
		if err != nil {
			_ = fs.Close()
			return nil, fmt.Errorf("opening the embedded store in %s: %w", spec.dir, err)
		}
		log.Debug("store opened", slog.String("store", spec.display))
		return &openedStore{
			Store:    fs,
			kind:     fileStore,
			display:  spec.display,
			id:       "file:" + dir,
			fenceDir: fence.StoreDir(dir),
			close:    func() { _ = fs.Close() },
		}, nil
	case postgresStore:
		return openPostgres(ctx, spec, log, forMigrate)
	case etcdStore:
		return openEtcd(ctx, spec, log)
	}
	return nil, errors.New("unknown store kind")
}
