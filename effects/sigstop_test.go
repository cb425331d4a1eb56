package effects_test

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/effects"
	"github.com/babelqueue/watermill-idempotency/internal/fakepay"
	"github.com/babelqueue/watermill-idempotency/internal/testenv"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
)

// TestSIGSTOPWhileConfirmingSendsNothing is
// TestPausedWhileConfirmingSendsNothing with a real SIGSTOP of a real
// process (Redis). Promised: an effect attempt paused past its lease after
// it took the lease and before it sends, while another attempt takes the
// effect over and sends, sends nothing.
//
// Worker 1 runs in a child process: it takes the charge's lease, is
// starved for three quarters of the lease (its Begin comes back late), so
// Confirm asks Redis; Redis answers "held", and right then the whole process
// is stopped with SIGSTOP (sent by itself to itself, so as to hit that
// instant). The parent waits for the child to be stopped, lets the lease
// lapse, charges as worker 2, then sends SIGCONT: the resumed worker 1
// finds Confirm's answer too stale to act on, asks again, and sends
// nothing; the provider (no idempotency keys) charges once.
func TestSIGSTOPWhileConfirmingSendsNothing(t *testing.T) {
	if os.Getenv("SIGSTOP_CHILD") != "" {
		t.Skip("the child's test")
	}
	t.Parallel()
	prefix := "ps" + testenv.RandomHex(6)
	rdb := testenv.Redis(t)
	t.Cleanup(func() { _ = testenv.DropKeys(context.Background(), rdb, "*"+prefix+"*") })
	provider, err := fakepay.Start(fakepay.Config{Lookups: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = provider.Close() })
	id := "msg-" + testenv.RandomHex(4)
	var out strings.Builder
	child := exec.Command(os.Args[0], "-test.run", "^TestSIGSTOPWhileConfirmingChild$", "-test.v")
	child.Env = append(os.Environ(), "SIGSTOP_CHILD=1", "SIGSTOP_PREFIX="+prefix, "SIGSTOP_PROVIDER="+provider.URL(), "SIGSTOP_ID="+id)
	child.Stdout, child.Stderr = &out, &out
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- child.Wait() }()
	defer func() {
		_ = child.Process.Signal(syscall.SIGCONT)
		_ = child.Process.Kill()
		<-exited
	}()
	testenv.Eventually(t, "worker 1 (the child) to stop itself right after Confirm's answer", func() bool {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", child.Process.Pid))
		if err != nil {
			return false
		}
		f := strings.Fields(string(b)[strings.LastIndexByte(string(b), ')')+1:])
		return len(f) > 0 && f[0] == "T"
	})
	second := redisstore.NewEffects(rdb, redisstore.WithEffectsPrefix(prefix))
	key := effects.ProviderKey("billing", id, "charge")
	testenv.Eventually(t, "worker 1's lease to pass while it is stopped", func() bool {
		e, err := second.Lookup(context.Background(), key)
		return err == nil && e.LeaseLapsed
	})
	client := fakepay.Client{BaseURL: provider.URL(), HTTP: &http.Client{}}
	res2, err := pauseWorker(t, second, client).Do(billingDelivery(id, "worker-2"), nil, chargeOrder(client))
	if err != nil || len(res2) == 0 {
		t.Fatalf("worker 2 after worker 1's lease passed: %q, %v; want the charge made", res2, err)
	}
	if err := child.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	select {
	case <-exited:
	case <-time.After(time.Minute):
		t.Fatalf("the child did not end\n%s", out.String())
	}
	exited <- nil // for the deferred wait
	if n := len(provider.Ledger()); n != 1 {
		t.Fatalf("the provider charged %d times (worker 2 got %q); want once: worker 1, SIGSTOPped right after Confirm's renewal was answered and resumed after its lease passed and worker 2 charged, charged too\nworker 1 (child) said:\n%s", n, res2, out.String())
	}
}

// TestSIGSTOPWhileConfirmingChild is worker 1 of
// TestSIGSTOPWhileConfirmingSendsNothing, run only as its child.
func TestSIGSTOPWhileConfirmingChild(t *testing.T) {
	if os.Getenv("SIGSTOP_CHILD") == "" {
		t.Skip("the child process of TestSIGSTOPWhileConfirmingSendsNothing")
	}
	const lease = time.Second
	client := fakepay.Client{BaseURL: os.Getenv("SIGSTOP_PROVIDER"), HTTP: &http.Client{}}
	store := &pausedInConfirm{EffectStore: redisstore.NewEffects(testenv.Redis(t), redisstore.WithEffectsPrefix(os.Getenv("SIGSTOP_PREFIX"))), lease: lease,
		pause: func() {
			// The whole process, right after Confirm's answer. A signal to
			// oneself lands asynchronously: the sleep keeps this goroutine
			// from going on (to the call) before the stop has landed; it
			// ends after SIGCONT.
			_ = syscall.Kill(os.Getpid(), syscall.SIGSTOP)
			time.Sleep(100 * time.Millisecond)
		}}
	res, err := pauseWorker(t, store, client).Do(billingDelivery(os.Getenv("SIGSTOP_ID"), "worker-1"), nil, chargeOrder(client))
	t.Logf("worker 1: Do = %q, %v", res, err)
}
