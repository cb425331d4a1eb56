package main

import (
	"bytes"
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

func TestPaymentsExample(t *testing.T) {
	t.Parallel()
	testenv.Redis(t) // skips (or fails under CI) when Redis is unreachable
	url := testenv.Getenv("REDIS_URL", testenv.DefaultRedisURL)
	testenv.RunExample(t, time.Minute, func(ctx context.Context, out io.Writer) error { return run(ctx, out, url, "127.0.0.1:0", 60) },
		"60 charges for 60 payments", "every payment charged exactly once",
		`bq_idempotency_deliveries_total{handler="charge-card",`, `outcome="run"`, `outcome="skip"`)
}

// TestPaymentsExampleEndsCleanly runs the example as a user would, a few
// times: it exits 0, writes nothing on standard error (go-redis complained
// there when a closing worker closed a client the other still read with),
// and leaves no key behind. It counts keys on the shared server: serial.
func TestPaymentsExampleEndsCleanly(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the example and runs it 4 times as a binary")
	}
	client := testenv.Redis(t)
	bin := filepath.Join(t.TempDir(), "payments")
	if out, err := testenv.GoBuild("-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	ctx := context.Background()
	leftovers := func() int {
		keys, err := client.Keys(ctx, "bq-example-*").Result()
		if err != nil {
			t.Fatal(err)
		}
		return len(keys)
	}
	before := leftovers()
	for i := range 4 {
		cmd := exec.Command(bin)
		cmd.Env = append(os.Environ(), "METRICS_ADDR=127.0.0.1:0", "REDIS_URL="+testenv.Getenv("REDIS_URL", testenv.DefaultRedisURL))
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := cmd.Run(); err != nil || stderr.Len() > 0 {
			t.Fatalf("run %d: %v, standard error:\n%s", i+1, err, stderr.String())
		}
		if !bytes.Contains(stdout.Bytes(), []byte("every payment charged exactly once")) {
			t.Fatalf("run %d:\n%s", i+1, stdout.String())
		}
	}
	if after := leftovers(); after != before {
		t.Fatalf("the example left %d keys behind", after-before)
	}
}
