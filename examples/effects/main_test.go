package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	mrand "math/rand/v2"
	"os"
	"os/exec"
	"os/signal"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/babelqueue/watermill-idempotency/effects"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/fakepay"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

func TestEffectsExample(t *testing.T) {
	testenv.Redis(t) // skips (or fails under CI) when Redis is unreachable
	url := testenv.Getenv("REDIS_URL", testenv.DefaultRedisURL)
	testenv.RunExample(t, 2*time.Minute, func(ctx context.Context, out io.Writer) error { return run(ctx, out, url, 30) },
		"30 orders", "every order charged exactly once",
		"charged 5 times (no second call)", "bq-idempotency effects list --state unknown:",
		"each charge parked as unknown for an operator; none sent twice")
}

// TestChargedOnceUnderSIGKILL: consumer processes are SIGKILLed at random
// moments (at least 8 times) while they charge 60 orders (a fifth
// published twice) through a provider that times out after charging, loses
// replies and sends callbacks twice and out of order; a second consumer
// runs throughout. Once the orders are drained, the provider's own ledger
// holds exactly one charge per order, and nothing was dead-lettered.
func TestChargedOnceUnderSIGKILL(t *testing.T) {
	if testing.Short() {
		t.Skip("kills and restarts consumer processes for about half a minute")
	}
	rdb := testenv.Redis(t)
	url := testenv.Getenv("REDIS_URL", testenv.DefaultRedisURL)
	run := testenv.RandomHex(4)
	s := Setup{RedisURL: url, Topic: "bq-fxcrash-" + run, Group: "billing", Prefix: "bq-fxcrash-" + run + ":", Keys: true}
	t.Cleanup(func() { cleanup(rdb, s) })

	fx, err := effects.New(redisstore.NewEffects(rdb, redisstore.WithEffectsPrefix(s.effectsPrefix())))
	if err != nil {
		t.Fatal(err)
	}
	defer fx.Close()
	hook, stopHook, err := Webhook(fx)
	if err != nil {
		t.Fatal(err)
	}
	defer stopHook()
	provider, err := fakepay.Start(fakepay.Config{IdempotentKeys: true, Lookups: true, Webhook: hook, Seed: mrand.Uint64(),
		Faults: fakepay.Faults{TimeoutAfterCharge: 0.2, LoseReply: 0.1, DuplicateCallback: 0.3, StaleCallback: 0.3}})
	if err != nil {
		t.Fatal(err)
	}
	defer provider.Close()
	s.ProviderURL = provider.URL()
	ctx := context.Background()
	const orders = 60
	ids, err := Publish(ctx, s, orders)
	if err != nil {
		t.Fatal(err)
	}

	setup, _ := json.Marshal(s)
	var logs, stableLogs bytes.Buffer
	consumer := func(name string, out *bytes.Buffer) *exec.Cmd {
		cmd := exec.Command(os.Args[0], "-test.run=^TestConsumerProcess$", "-test.count=1", "-test.v")
		cmd.Env = append(os.Environ(), "EFFECTS_ROLE=consumer", "EFFECTS_SETUP="+string(setup), "EFFECTS_CONSUMER="+name)
		cmd.Stdout, cmd.Stderr = out, out
		return cmd
	}
	stable := consumer("stable", &stableLogs)
	if err := stable.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = stable.Process.Signal(syscall.SIGTERM)
		_ = stable.Wait()
	}()
	drained := func() bool {
		done, err := Done(ctx, rdb, s, fx.Store(), orders)
		if err != nil {
			t.Fatal(err)
		}
		return done
	}
	const minKills = 8
	kills := 0
	deadline := time.Now().Add(3 * time.Minute)
	for kills < minKills || !drained() {
		if time.Now().After(deadline) {
			t.Fatalf("not drained after %d kills; consumer output:\n%s", kills, tail(logs.String()+stableLogs.String()))
		}
		cmd := consumer("victim", &logs)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		if kills < minKills {
			time.Sleep(time.Duration(300+mrand.IntN(700)) * time.Millisecond)
			_ = cmd.Process.Signal(syscall.SIGKILL)
			_ = cmd.Wait()
			kills++
			continue
		}
		for !drained() && time.Now().Before(deadline) {
			time.Sleep(100 * time.Millisecond)
		}
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
	}

	requests, faults := provider.Stats()
	perOrder := provider.ChargesPerOrder()
	t.Logf("%d orders, %d SIGKILLs, %d charge requests; injected %s; ledger %d charges", orders, kills, requests, describe(faults), len(provider.Ledger()))
	for _, id := range ids {
		if perOrder[id] != 1 {
			t.Errorf("%s charged %d times", id, perOrder[id])
		}
	}
	if n := len(provider.Ledger()); n != orders {
		t.Fatalf("the ledger holds %d charges for %d orders", n, orders)
	}
	if dead, err := rdb.XLen(ctx, s.Topic+".dlq").Result(); err != nil || dead != 0 {
		t.Fatalf("%d messages dead-lettered (%v)", dead, err)
	}
}

func tail(s string) string {
	if len(s) > 4000 {
		return s[len(s)-4000:]
	}
	return s
}

// TestConsumerProcess is the consumer TestChargedOnceUnderSIGKILL kills;
// it only runs as its child.
func TestConsumerProcess(t *testing.T) {
	if os.Getenv("EFFECTS_ROLE") != "consumer" {
		t.Skip("the SIGKILL test's consumer process")
	}
	var s Setup
	if err := json.Unmarshal([]byte(os.Getenv("EFFECTS_SETUP")), &s); err != nil {
		t.Fatal(err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	if err := Consume(ctx, s, os.Getenv("EFFECTS_CONSUMER"), watermill.NopLogger{}); err != nil && ctx.Err() == nil {
		t.Fatal(err)
	}
}
