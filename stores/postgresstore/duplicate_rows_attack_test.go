package postgresstore_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// A worker with claims of rows writes a message's end (stores.Fail with
// an End) while a session claim of another worker holds the key: after
// its own claim was released (the Guard without WithRetries releases the
// claim, then writes the end once the router acked the dead letter), or
// after its claim lapsed and the session claim took it over. The end is
// refused (ErrClaimTaken), as a record would be, and duplicates stay in
// flight while the session's holder runs the message. The rows' Fail took
// no advisory lock: it wrote the end under the session claim, and the
// message was both dead-lettered and run again.
func TestDuplicateAttackRowsWorkerEndsUnderASessionClaim(t *testing.T) {
	t.Parallel()
	for _, d := range maDrivers {
		for _, lapsed := range []bool{false, true} {
			name := d.name + "/released"
			if lapsed {
				name = d.name + "/lapsed"
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				a, b := daPair(t)
				w := newStoreOnTable(t, h2DriverPool(t, d.driver), a.Table(), d.opts...)
				key := "da-rows-" + testenv.RandomHex(4)
				wctx := stores.WithClaimToken(context.Background(), "rows-worker")
				if claimed, _, err := w.Claim(wctx, key, 200*time.Millisecond); err != nil || !claimed {
					t.Fatalf("the rows worker's claim = %v, %v", claimed, err)
				}
				if !lapsed {
					if err := w.Release(wctx, key); err != nil {
						t.Fatal(err)
					}
				}
				waitCond(t, "the session claims the key", 5*time.Second, func() bool {
					claimed, _, err := a.Claim(stores.WithClaimToken(context.Background(), "session"), key, 5*time.Second)
					return err == nil && claimed
				})
				err := w.Fail(wctx, key, 7, stores.Failure{Attempts: 1, End: &stores.End{Reason: "failed"}})
				if !errors.Is(err, stores.ErrClaimTaken) {
					t.Errorf("the rows worker's end while a session claim holds the key = %v; want ErrClaimTaken", err)
				}
				daInFlight(t, b, "dup", key, "a duplicate while the session's holder runs the message")
				if err := a.Remember(stores.WithClaimToken(context.Background(), "session"), key, 7, []byte("done")); err != nil {
					t.Fatal(err)
				}
				if claimed, found := daClaim(t, b, "dup", key); claimed || !found.Remembered() {
					t.Errorf("a duplicate after the session's record = %v, %+v; want the record", claimed, found)
				}
			})
		}
	}
}
