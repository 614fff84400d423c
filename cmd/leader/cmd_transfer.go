//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"time"

	"github.com/leaderelect/leader"
)

var transferCommand = &command{
	name:     "transfer",
	synopsis: "leader transfer --name NAME [--to ID] [flags]",
	summary:  "ask the leader of an election to hand over to another instance",
	help: `
Asks the instance that leads the election NAME to hand over: to the
instance whose ID is --to, or, without --to, to the best one (the highest
"leader run --priority"; among equals, any). Any host may ask; the leader
acts at its next renewal (within a third of its --ttl): it stops its
command as on loss, then releases the lease reserved for the successor,
which starts its command at once with the next term while the other
instances wait. Prints the new leader once it holds the lease.

If the successor does not take the lease within a third of the leader's
--ttl (it stopped, or cannot reach the store), the lease is released as
usual and any instance may take it: transfer then fails (exit code 1), saying who leads.

Exit codes: 0 handed over, 1 not handed over (nobody leads, no instance
with that ID campaigns, the successor did not take the lease, --timeout
passed, or a store error; the message says which: nothing changed unless it
says the lease was released), 2 usage error.
`,
}

func init() {
	transferCommand.flags = func() *flag.FlagSet { return new(statusOptions).flags("transfer") }
	transferCommand.run = runTransfer
}

func runTransfer(a *app, ctx context.Context, args []string) int {
	var o statusOptions
	view, fail, code, ok := o.setup(a, ctx, transferCommand, args)
	if !ok {
		return code
	}
	defer view.Close()
	before, _, err := view.look(ctx)
	if err != nil {
		return fail(fmt.Errorf("reading the lease of %q: %w", o.name, err))
	}
	if !before.Held() {
		return fail(fmt.Errorf("election %q: nobody leads (last term %d): there is nothing to hand over", o.name, before.Term))
	}
	tctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	l, err := leader.RequestTransfer(tctx, view.store.Store, o.name, o.to)
	switch {
	case errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil:
		return fail(fmt.Errorf("election %q: %s did not hand over within --timeout %v (it acts at its next renewal; is its version older than transfers?)", o.name, before.HolderID, o.timeout))
	case err != nil:
		return fail(err)
	}
	if o.json {
		writeJSON(a.stdout, leaseJSON(o.name, l, time.Time{}))
		return exitOK
	}
	fmt.Fprintf(a.stdout, "%s handed election %q over to %s (term %d -> %d)\n", before.HolderID, o.name, l.HolderID, before.Term, l.Term)
	return exitOK
}
