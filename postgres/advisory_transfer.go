package postgres

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leaderelect/leader"
)

// RequestTransfer implements leader.Transferer. In one statement, on the
// store's own connections, it records req on the name's row, pending until
// ttl has passed on the server's clock (a ttl that is not positive clears
// it), if the lease is held, and returns the lease as Observe would. If
// the lease is not held it returns the lease as it stands and an error
// wrapping leader.ErrNoLeader. The holder reads the request at its next
// heartbeat (Renew).
func (s *AdvisoryStore) RequestTransfer(ctx context.Context, name string, req leader.TransferRequest, ttl time.Duration) (leader.Lease, error) {
	ctx, cancel := s.opts.bound(ctx)
	defer cancel()
	const op = "request transfer"
	hi, lo := keyHalves(s.Key(name))
	to, why, pending := requestArgs(req, ttl)
	var (
		term       int64
		holderID   string
		acquiredAt *time.Time
		held       bool
		remaining  time.Duration
		transfer   transferRow
		recorded   bool
	)
	dest := append([]any{&term, &holderID, &acquiredAt, &held, &remaining}, transfer.dest()...)
	err := s.pool.QueryRow(ctx, s.sql.request, name, hi, lo, to, why, pending).Scan(append(dest, &recorded)...)
	if errors.Is(err, pgx.ErrNoRows) {
		return leader.Lease{Name: name}, noLeader(name)
	}
	if err != nil {
		return leader.Lease{}, wrapError(ctx, call(op, name), err)
	}
	l := observed(name, term, holderID, acquiredAt, held, remaining, transfer)
	if !recorded {
		return l, noLeader(name)
	}
	return l, nil
}
