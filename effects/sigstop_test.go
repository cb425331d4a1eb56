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
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/fakepay"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestSIGSTOPBeforeTheCallSendsNothing is TestPausedBeforeTheCallSendsNothing
// with a real SIGSTOP of a real process (Redis): worker 1, a child process,
// takes the charge's lease and stops itself (SIGSTOP) right after. The
// parent waits for the child to be stopped, lets the lease lapse, charges
// as worker 2, then sends SIGCONT: worker 1 asks the store before its call,
// finds the effect another attempt's, and sends nothing; the provider (no
// idempotency keys) charges once.
func TestSIGSTOPBeforeTheCallSendsNothing(t *testing.T) {
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
	child := exec.Command(os.Args[0], "-test.run", "^TestSIGSTOPBeforeTheCallChild$", "-test.v")
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
	testenv.Eventually(t, "worker 1 (the child) to stop itself right after it took the lease", func() bool {
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
		t.Fatalf("the provider charged %d times (worker 2 got %q); want once: worker 1, SIGSTOPped right after it took the lease and resumed after its lease passed and worker 2 charged, charged too\nworker 1 (child) said:\n%s", n, res2, out.String())
	}
}

// TestSIGSTOPBeforeTheCallChild is worker 1 of
// TestSIGSTOPBeforeTheCallSendsNothing, run only as its child.
func TestSIGSTOPBeforeTheCallChild(t *testing.T) {
	if os.Getenv("SIGSTOP_CHILD") == "" {
		t.Skip("the child process of TestSIGSTOPBeforeTheCallSendsNothing")
	}
	client := fakepay.Client{BaseURL: os.Getenv("SIGSTOP_PROVIDER"), HTTP: &http.Client{}}
	store := &pausedAfterBegin{EffectStore: redisstore.NewEffects(testenv.Redis(t), redisstore.WithEffectsPrefix(os.Getenv("SIGSTOP_PREFIX"))),
		pause: func() {
			// The whole process, right after it took the lease. A signal to
			// oneself lands asynchronously: the sleep keeps this goroutine
			// from going on (to the call) before the stop has landed; it
			// ends after SIGCONT.
			_ = syscall.Kill(os.Getpid(), syscall.SIGSTOP)
			time.Sleep(100 * time.Millisecond)
		}}
	res, err := pauseWorker(t, store, client).Do(billingDelivery(os.Getenv("SIGSTOP_ID"), "worker-1"), nil, chargeOrder(client))
	t.Logf("worker 1: Do = %q, %v", res, err)
}
