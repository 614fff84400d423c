//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"context"
	"errors"
	"log/slog"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/postgres"
)

// Refusals are store errors that retrying will not mend (they wrap
// leader.ErrPermanent): a wrong password, tables never migrated, missing
// privileges, or an election that the other PostgreSQL strategy uses
// (*postgres.StrategyConflictError). Before any store call has succeeded,
// the Elector's Run returns one at once, and "leader run" exits 125 with
// its message, which says what to do.

// refusalFilter is a slog.Handler that drops records at ERROR that carry a
// refusal while quiet reports true: "leader run" sets quiet until a store
// call of its Elector has succeeded, as until then the Elector logs a
// refusal only as it returns it from Run, and "leader run" prints the
// error, once, as its own last word. Later refusals, which the Elector
// retries with backoff, are logged.
type refusalFilter struct {
	slog.Handler
	quiet func() bool
}

func (h refusalFilter) Handle(ctx context.Context, r slog.Record) error {
	if r.Level >= slog.LevelError && carriesRefusal(r) && h.quiet() {
		return nil
	}
	return h.Handler.Handle(ctx, r)
}

func (h refusalFilter) WithAttrs(attrs []slog.Attr) slog.Handler {
	return refusalFilter{Handler: h.Handler.WithAttrs(attrs), quiet: h.quiet}
}

func (h refusalFilter) WithGroup(name string) slog.Handler {
	return refusalFilter{Handler: h.Handler.WithGroup(name), quiet: h.quiet}
}

// carriesRefusal reports whether one of r's attributes is a refusal.
func carriesRefusal(r slog.Record) bool {
	found := false
	r.Attrs(func(a slog.Attr) bool {
		err, ok := a.Value.Any().(error)
		found = ok && errors.Is(err, leader.ErrPermanent)
		return !found
	})
	return found
}

// strategyConflict returns the *postgres.StrategyConflictError in err's
// chain, or nil. Its message names the election, both strategies and what
// to do, without the store call's prefix.
func strategyConflict(err error) *postgres.StrategyConflictError {
	var conflict *postgres.StrategyConflictError
	if errors.As(err, &conflict) {
		return conflict
	}
	return nil
}
