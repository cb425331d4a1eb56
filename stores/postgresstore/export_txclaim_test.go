package postgresstore

import (
	"context"
	"time"
)

// ExtendTx renews the caller's transaction claim on key (see extendTx):
// done false when the caller holds none.
func (s *Store) ExtendTx(ctx context.Context, key string, lease time.Duration) (done, held bool, err error) {
	return s.extendTx(ctx, key, lease)
}
