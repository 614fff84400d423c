package pgtest

import (
	"errors"
	"fmt"
	"strings"
)

// StandaloneOptions configure a cluster started by StartStandalone.
type StandaloneOptions struct {
	// Settings are extra postgresql.conf lines, such as
	// "shared_preload_libraries = 'pg_stat_statements'" or
	// "max_connections = 1500". They come after the defaults, so they
	// override them. A setting that needs a restart (like those two) takes
	// effect, as StartStandalone restarts the server after writing them.
	Settings []string
}

// Standalone is a throwaway cluster for programs that are not tests (the
// benchmark, for one): the same cluster the tests get (initdb into a
// temporary directory, a random free port on 127.0.0.1, fsync off, run as
// the "postgres" OS user when the caller is root), with a watchdog that
// stops it and removes its files if the program dies without calling Close.
type Standalone struct {
	s *localServer
}

// StartStandalone starts a throwaway cluster from the installed server
// binaries and waits until it accepts connections. Call Close when done.
func StartStandalone(opts StandaloneOptions) (*Standalone, error) {
	s, err := startServer()
	if err != nil {
		return nil, err
	}
	if len(opts.Settings) > 0 {
		if err := s.appendSettings(opts.Settings); err != nil {
			return nil, errors.Join(err, s.close())
		}
	}
	return &Standalone{s: s}, nil
}

// appendSettings adds lines to postgresql.conf and restarts the server so
// that they all take effect.
func (s *localServer) appendSettings(lines []string) error {
	for _, l := range lines {
		if strings.ContainsAny(l, "\n\r") {
			return fmt.Errorf("pgtest: setting %q spans lines", l)
		}
	}
	if err := s.appendToFile("postgresql.conf", "\n"+strings.Join(lines, "\n")+"\n"); err != nil {
		return err
	}
	if err := s.stop("fast"); err != nil {
		return err
	}
	if err := s.start(); err != nil {
		return fmt.Errorf("%w (after adding settings %q)", err, lines)
	}
	return nil
}

// ConnString returns a connection string for the superuser "postgres" on
// database.
func (c *Standalone) ConnString(database string) string { return c.s.connString(database) }

// Addr returns the server's address, "127.0.0.1:port".
func (c *Standalone) Addr() string { return c.s.addr() }

// Close stops the server at once and removes its files.
func (c *Standalone) Close() error { return c.s.close() }
