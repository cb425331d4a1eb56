package sdkstore

import (
	"context"
	"fmt"

	"github.com/babelqueue/watermill-idempotency/stores"
)

// notSupported is the Fail and Reopen of the layouts that cannot keep
// failures (Capabilities().Failures is false).
type notSupported struct{}

// Fail is not supported by this layout.
func (notSupported) Fail(context.Context, string, uint64, stores.Failure) error {
	return fmt.Errorf("sdkstore: fail: %w", stores.ErrNotSupported)
}

// Reopen is not supported by this layout.
func (notSupported) Reopen(context.Context, string, string) (bool, error) {
	return false, fmt.Errorf("sdkstore: reopen: %w", stores.ErrNotSupported)
}
