package redrive_test

import (
	"errors"
	"testing"

	"github.com/babelqueue/watermill-idempotency/pubsub/redislist"
	"github.com/babelqueue/watermill-idempotency/redrive"
)

// The Redis list subscriber is a Browser, for the dry run on the SDKs' lists.
var _ redrive.Browser = (*redislist.Subscriber)(nil)

// TestTopicNotFoundIsOneValue: a Browse of pubsub/redislist, which does not
// import this package, reports a missing topic with an error that matches
// ErrTopicNotFound.
func TestTopicNotFoundIsOneValue(t *testing.T) {
	t.Parallel()
	if !errors.Is(redislist.ErrTopicNotFound, redrive.ErrTopicNotFound) {
		t.Fatal("redislist.ErrTopicNotFound does not match redrive.ErrTopicNotFound")
	}
}
