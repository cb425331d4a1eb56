package redisstore

import (
	"context"
	"fmt"

	"github.com/babelqueue/watermill-idempotency/stores"
)

// Fail is not supported yet (Capabilities().Failures is false).
func (s *Store) Fail(context.Context, string, uint64, stores.Failure) error {
	return fmt.Errorf("redisstore: fail: %w", stores.ErrNotSupported)
}

// Reopen is not supported yet (Capabilities().Failures is false).
func (s *Store) Reopen(context.Context, string, string) (bool, error) {
	return false, fmt.Errorf("redisstore: reopen: %w", stores.ErrNotSupported)
}
