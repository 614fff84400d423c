//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

import (
	"context"
	"errors"
	"log/slog"
	"time"

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

// minMoveWait is the shortest wait of campaign between two looks at an
// election that is moving from the other strategy.
const minMoveWait = 250 * time.Millisecond

// campaign runs elector until ctx ends (nil) or Run returns an error, which
// it returns. An election that the other PostgreSQL strategy holds is a
// misconfiguration (candidates of both strategies at once): Run's
// *postgres.StrategyConflictError is returned at once. An election that the
// other strategy used within its TTL but that nobody holds is a fleet
// moving to this strategy: its old candidates were stopped, and the store
// lets the election move a TTL after the last one stopped; campaign waits
// for that, and runs elector again.
func campaign(ctx context.Context, elector *leader.Elector, log *slog.Logger) error {
	for {
		err := elector.Run(ctx)
		conflict := strategyConflict(err)
		if conflict == nil || conflict.Held {
			return err
		}
		// Until is on the server's clock: wait at most a TTL at a time, and
		// look again if that was too early.
		wait := min(max(time.Until(conflict.Until), minMoveWait), elector.Config().TTL)
		log.Info("waiting for the election to move to this strategy: the other one used it within its TTL, and nobody holds it now",
			slog.String("from", string(conflict.InUse)), slog.String("to", string(conflict.Want)),
			slog.Time("until", conflict.Until), slog.Duration("wait", wait.Round(time.Millisecond)))
		timer := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			timer.Stop()
			return nil
		case <-timer.C:
		}
	}
}
