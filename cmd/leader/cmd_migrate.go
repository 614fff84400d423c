//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"context"
	"flag"
	"fmt"

	"github.com/leaderelect/leader/cmd/leader/internal/redact"
)

var migrateCommand = &command{
	name:     "migrate",
	synopsis: "leader migrate [--store URL] [flags]",
	summary:  "create or update the PostgreSQL schema",
	help: `
Creates or updates the store's schema: on PostgreSQL, the tables of both
strategies (lease and advisory) and what goes with them, in one transaction, safe to run from several hosts at once
and again at every deploy. "leader run" and the other subcommands do not
create the schema themselves. The embedded store needs no schema: migrate
says so and exits 0.

Exit codes: 0 done (or nothing to do), 1 store error, 2 usage error.
`,
}

func init() {
	migrateCommand.flags = func() *flag.FlagSet { return new(migrateOptions).flags() }
	migrateCommand.run = runMigrate
}

type migrateOptions struct {
	commonOptions
}

func (o *migrateOptions) flags() *flag.FlagSet {
	fs := flag.NewFlagSet("migrate", flag.ContinueOnError)
	o.commonOptions.register(fs, "warn")
	return fs
}

func runMigrate(a *app, ctx context.Context, args []string) int {
	var o migrateOptions
	fs := o.flags()
	if _, code, ok := a.parse(migrateCommand, fs, args, false); !ok {
		return code
	}
	rawStore, storeErr := o.storeURL(a, fs)
	red := redact.ForURL(rawStore)
	fail := func(err error) int { return a.fail("migrate", red, err) }
	log, err := o.logger(a.stderr, red)
	if err != nil {
		return fail(err)
	}
	if storeErr != nil {
		return fail(storeErr)
	}
	spec, err := parseStoreURL(rawStore)
	if err != nil {
		return fail(err)
	}
	switch spec.kind {
	case fileStore:
		fmt.Fprintf(a.stdout, "The embedded store (%s) has no schema: nothing to migrate.\n", spec.display)
		return exitOK
	case etcdStore:
		fmt.Fprintf(a.stdout, "The etcd store (%s) has no schema: nothing to migrate.\n", spec.display)
		return exitOK
	}
	store, err := openStoreFor(ctx, spec, log, true)
	if err != nil {
		return fail(err)
	}
	defer store.Close()
	if err := store.migrate(ctx); err != nil {
		return fail(fmt.Errorf("migrating %s: %w", store.display, err))
	}
	fmt.Fprintf(a.stdout, "The schema on %s is up to date.\n", store.display)
	return exitOK
}
