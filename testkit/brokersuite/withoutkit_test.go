package brokersuite

import (
	"fmt"
	"os"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/pubsub/redislist"
)

// failures is a testing.TB that records failures instead of reporting
// them: Fatal stops the case's goroutine, as testing.T does. Everything
// else (Cleanup, Helper, Log) goes to the real test.
type failures struct {
	testing.TB
	mu   sync.Mutex
	msgs []string
}

func (f *failures) record(msg string) {
	f.mu.Lock()
	f.msgs = append(f.msgs, msg)
	f.mu.Unlock()
}

func (f *failures) Error(args ...any)                 { f.record(fmt.Sprint(args...)) }
func (f *failures) Errorf(format string, args ...any) { f.record(fmt.Sprintf(format, args...)) }
func (f *failures) Fail()                             { f.record("Fail") }
func (f *failures) Fatal(args ...any)                 { f.record(fmt.Sprint(args...)); runtime.Goexit() }
func (f *failures) Fatalf(format string, args ...any) {
	f.record(fmt.Sprintf(format, args...))
	runtime.Goexit()
}
func (f *failures) FailNow() { f.record("FailNow"); runtime.Goexit() }
func (f *failures) Failed() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.msgs) > 0
}

// first returns the first failure recorded.
func (f *failures) first() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.msgs) == 0 {
		return ""
	}
	return f.msgs[0]
}

// TestEachCaseFailsWithoutTheKit runs every case with the kit's middleware
// taken out of the router (no idempotency guard, no dead letters; Retry
// stays) and checks that each one fails: the suite proves what the kit
// does, not what the broker does anyway. It runs on the SDK reliable list
// (the quickest broker here); BROKERSUITE_WITHOUT_KIT_ALL=1 runs it on
// every broker.
func TestEachCaseFailsWithoutTheKit(t *testing.T) {
	if testing.Short() {
		t.Skip("waits out the suite's timeouts, case by case, without the kit")
	}
	brokers := []Broker{redisList(redislist.LayoutReliableList)}
	if os.Getenv("BROKERSUITE_WITHOUT_KIT_ALL") != "" {
		brokers = append(brokers, redisStreams, postgreSQL, redisList(redislist.LayoutLaravel), rabbitMQ, natsJetStream, kafkaBroker)
	}
	for _, b := range brokers {
		t.Run(b.Name, func(t *testing.T) {
			for _, c := range cases {
				t.Run(c.name, func(t *testing.T) {
					t.Parallel()
					if c.limit && b.MaxMessage == 0 {
						t.Skipf("%s: no message limit a test can reach", b.Name)
					}
					f := &failures{TB: t}
					done := make(chan struct{})
					go func() {
						defer close(done)
						c.run(f, b, settings{withoutKit: true, wait: 5 * time.Second})
					}()
					<-done
					if !f.Failed() {
						t.Fatalf("%s passed on %s without the kit: it does not prove the kit", c.name, b.Name)
					}
					t.Logf("without the kit: %s", f.first())
				})
			}
		})
	}
}
