package brokersuite

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package when a test leaves a goroutine behind: every
// router, subscriber, publisher and connection a test opens is closed.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
