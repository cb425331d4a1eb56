package crashtest

import (
	"bytes"
	"context"
	"syscall"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/internal/testenv"
)

// TestPausedTxClaimHolderFindsItsClaimLost (attack on the chaos mode
// TestChaosTxClaims, commit 169e56e): TestPausedHolderFindsItsClaimLost
// with postgresstore WithTransactionClaims. Promised: a consumer paused
// past its lease loses its claim (idle_in_transaction_session_timeout ends
// its transaction), the other consumer runs the message, and the resumed
// holder's handler context ends with ErrClaimLost; one record.
func TestPausedTxClaimHolderFindsItsClaimLost(t *testing.T) {
	if testing.Short() {
		t.Skip("pauses a consumer process past its lease")
	}
	t.Parallel()
	s, runs := handoverSetup(t, handoverTxClaims, "pausedtx")
	var doomedLogs, survivorLogs bytes.Buffer
	doomed := s.consumer("doomed", &doomedLogs)
	if err := doomed.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = doomed.Process.Signal(syscall.SIGCONT)
		_ = doomed.Process.Signal(syscall.SIGTERM)
		_ = doomed.Wait()
	}()
	waitFor(t, "the holder to start the handler", time.Minute, func() bool { return runs("doomed") == 1 })
	survivor := s.consumer("survivor", &survivorLogs)
	if err := survivor.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = survivor.Process.Signal(syscall.SIGTERM)
		_ = survivor.Wait()
	}()
	if err := doomed.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the survivor to run the message while the holder is paused", 2*time.Minute, func() bool { return runs("survivor") == 1 })
	if err := doomed.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the resumed holder's handler to see its claim lost", time.Minute, func() bool { return runs("doomed, claim lost") == 1 })
	if n := runs("survivor") + runs("doomed"); n != 2 {
		t.Fatalf("%d runs, want the holder's (cancelled) and the survivor's\ndoomed:\n%s\nsurvivor:\n%s", n, doomedLogs.String(), survivorLogs.String())
	}
	var records int
	db := testenv.Postgres(t)
	if err := db.QueryRowContext(context.Background(), `SELECT count(*) FROM `+s.store).Scan(&records); err != nil || records != 1 {
		t.Fatalf("%d records (%v), want 1", records, err)
	}
}
