package etcd

import (
	"context"
	"errors"
	"fmt"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/leaderelect/leader"
)

// wrapError says what failed ("acquire \"nightly\"") and classifies err so
// that callers can branch with errors.Is:
//
//   - the caller's context error when ctx ended (whatever the client made
//     of it);
//   - ErrClosed when Close cut the call short;
//   - leader.ErrPermanent, with what to do, when etcd refused for want of
//     authentication or permission;
//   - leader.ErrUnavailable when etcd could not be reached, had no leader,
//     timed out, or did not answer within the call timeout: the outcome of
//     a write is then unknown.
func (s *Store) wrapError(ctx context.Context, what string, err error) error {
	prefix := "etcd: " + what
	if ctxErr := ctx.Err(); ctxErr != nil {
		if errors.Is(err, ctxErr) {
			return fmt.Errorf("%s: %w", prefix, err)
		}
		return fmt.Errorf("%s: %w: %w", prefix, ctxErr, err)
	}
	if s.bg.Err() != nil {
		return fmt.Errorf("%s: %w: %w", prefix, ErrClosed, err)
	}
	switch {
	case isPermanent(err):
		return fmt.Errorf("%s: %w: the etcd user lacks a permission or could not authenticate: give it read and write on the keys under the Store's prefix (etcdctl role grant-permission --prefix <role> readwrite %q): %w", prefix, leader.ErrPermanent, s.prefix, err)
	case isUnavailable(err):
		return fmt.Errorf("%s: %w: %w", prefix, leader.ErrUnavailable, err)
	}
	return fmt.Errorf("%s: %w", prefix, err)
}

// code returns the gRPC code of an error of the etcd client.
func code(err error) codes.Code {
	var ee rpctypes.EtcdError
	if errors.As(err, &ee) {
		return ee.Code()
	}
	if st, ok := status.FromError(err); ok {
		return st.Code()
	}
	return codes.Unknown
}

func isPermanent(err error) bool {
	switch code(err) {
	case codes.PermissionDenied, codes.Unauthenticated:
		return true
	}
	return errors.Is(err, rpctypes.ErrPermissionDenied) || errors.Is(err, rpctypes.ErrAuthFailed) ||
		errors.Is(err, rpctypes.ErrInvalidAuthToken) || errors.Is(err, rpctypes.ErrUserEmpty)
}

func isUnavailable(err error) bool {
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) ||
		errors.Is(err, clientv3.ErrNoAvailableEndpoints) {
		// The call timeout, or the client closing: not the caller's
		// context, which wrapError tested first.
		return true
	}
	switch code(err) {
	case codes.Unavailable, codes.DeadlineExceeded, codes.Canceled, codes.Aborted, codes.ResourceExhausted:
		return true
	}
	return false
}

// isLeaseNotFound reports whether etcd refused a request because a lease
// it names does not exist (any more).
func isLeaseNotFound(err error) bool {
	return errors.Is(err, rpctypes.ErrLeaseNotFound) || errors.Is(err, rpctypes.ErrGRPCLeaseNotFound)
}

// lostError is an error wrapping leader.ErrLeaseLost.
func lostError(what string, term uint64, why string) error {
	return fmt.Errorf("etcd: %s term %d: %s: %w", what, term, why, leader.ErrLeaseLost)
}

// closedLost adds leader.ErrLeaseLost to err if err says that Close cut
// the call short: a closed Store keeps no lease alive (see ErrClosed).
func closedLost(err error) error {
	if errors.Is(err, ErrClosed) && !errors.Is(err, leader.ErrLeaseLost) {
		return fmt.Errorf("%w: %w", err, leader.ErrLeaseLost)
	}
	return err
}
