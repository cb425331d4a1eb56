package brokersuite

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/babelqueue/watermill-idempotency/testkit/kafkatest"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestMain fails the package when a test leaves a goroutine behind: every
// router, subscriber, publisher and connection a test opens is closed. The
// tests run with testenv.SetParallelism.
func TestMain(m *testing.M) {
	testenv.SetParallelism()
	goleak.VerifyTestMain(m, kafkatest.IgnoreGoroutines()...)
}
