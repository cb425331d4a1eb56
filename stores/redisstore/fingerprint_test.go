package redisstore_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestValueRecordsKeepTheWholeFingerprint: a record with a value keeps all
// 64 bits of its fingerprint (a record without one keeps the reduced form,
// 2 to 9999), and one written with the reduced form by an earlier release
// still matches its own content.
func TestValueRecordsKeepTheWholeFingerprint(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	ctx := context.Background()
	prefix := "bqtest:" + testenv.RandomHex(6) + ":"
	t.Cleanup(func() { _ = testenv.DropKeys(context.Background(), client, prefix+"*") })
	s := redisstore.New(client, redisstore.WithPrefix(prefix))
	caps := s.Capabilities()
	const fp uint64 = 0xfeedfacecafebeef
	twin := fp + 9998 // the same reduced form

	if err := s.Remember(ctx, "with-value", fp, []byte("answer")); err != nil {
		t.Fatal(err)
	}
	if got := client.Get(ctx, s.RedisKey("with-value")).Val(); got != "v"+strconv.FormatUint(fp, 10)+":answer" {
		t.Fatalf("a record with a value holds %q, want the whole fingerprint", got)
	}
	if err := s.Remember(ctx, "no-value", fp, nil); err != nil {
		t.Fatal(err)
	}
	if got := client.Get(ctx, s.RedisKey("no-value")).Val(); got != strconv.FormatUint(caps.KeptFingerprint(fp), 10) {
		t.Fatalf("a record without a value holds %q, want the reduced form %d", got, caps.KeptFingerprint(fp))
	}
	for key, wantTwin := range map[string]bool{"with-value": false, "no-value": true} {
		r, err := s.Lookup(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		if !caps.Matches(r.Fingerprint, fp) || caps.Matches(r.Fingerprint, twin) != wantTwin {
			t.Errorf("%s: kept %d; Matches(its own) = %v, Matches(a twin under the reduced form) = %v; want true, %v",
				key, r.Fingerprint, caps.Matches(r.Fingerprint, fp), caps.Matches(r.Fingerprint, twin), wantTwin)
		}
	}

	// Written by an earlier release: "v", the reduced form, ":", the value.
	legacy := "v" + strconv.FormatUint(caps.KeptFingerprint(fp), 10) + ":answer"
	if err := client.Set(ctx, s.RedisKey("legacy"), legacy, 0).Err(); err != nil {
		t.Fatal(err)
	}
	r, err := s.Lookup(ctx, "legacy")
	if err != nil || string(r.Value) != "answer" || !caps.Matches(r.Fingerprint, fp) {
		t.Fatalf("a value record of an earlier release: %+v, %v; want its value, matching its own fingerprint", r, err)
	}
}
