package idempotency_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
)

// The BabelQueue SDKs' field encryption, as their producers put it on the
// wire: each value at a path the job's schema marks x-gdpr-sensitive is
// JSON-encoded and replaced in place by the cipher's string; the SDKs'
// AES-GCM cipher seals with a random 12-byte nonce per call, prepends it and
// encodes the whole in standard, padded base64. The Go SDK's module is not
// served to the test machines, so these helpers are that contract written
// out; sdkCipher has the method set of the Go SDK's gdpr.AESGCMCipher, and
// testdata/sdk_gdpr_producer.py is the Python SDK's producer side.

// sdkCipher is the SDKs' AES-GCM field cipher.
type sdkCipher struct{ aead cipher.AEAD }

func newSDKCipher(t testing.TB, key []byte) *sdkCipher {
	t.Helper()
	block, err := aes.NewCipher(key)
	if err != nil {
		t.Fatal(err)
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		t.Fatal(err)
	}
	return &sdkCipher{aead: aead}
}

// Encrypt seals plaintext under a fresh random nonce.
func (c *sdkCipher) Encrypt(plaintext []byte) (string, error) {
	nonce := make([]byte, c.aead.NonceSize())
	if _, err := rand.Read(nonce); err != nil {
		return "", err
	}
	return base64.StdEncoding.EncodeToString(c.aead.Seal(nonce, nonce, plaintext, nil)), nil
}

// Decrypt opens what Encrypt sealed; a wrong key or another string fails.
func (c *sdkCipher) Decrypt(ciphertext string) ([]byte, error) {
	raw, err := base64.StdEncoding.DecodeString(ciphertext)
	if err != nil {
		return nil, fmt.Errorf("malformed ciphertext: %w", err)
	}
	n := c.aead.NonceSize()
	if len(raw) < n {
		return nil, errors.New("malformed ciphertext: shorter than a nonce")
	}
	return c.aead.Open(nil, raw[:n], raw[n:], nil)
}

// sdkFields applies op in place to every value of data at the sensitive
// paths, as the SDKs' Protect and Unprotect walk them ("a.b", "list[]",
// "list[].field"); an absent path is skipped.
func sdkFields(data map[string]any, paths []string, op func(any) (any, error)) error {
	var at func(node any, segs []string) error
	at = func(node any, segs []string) error {
		obj, ok := node.(map[string]any)
		if !ok || len(segs) == 0 {
			return nil
		}
		key, array := strings.CutSuffix(segs[0], "[]")
		child, present := obj[key]
		if !present {
			return nil
		}
		last := len(segs) == 1
		if array {
			list, ok := child.([]any)
			if !ok {
				return nil
			}
			for i, elem := range list {
				if !last {
					if err := at(elem, segs[1:]); err != nil {
						return err
					}
					continue
				}
				v, err := op(elem)
				if err != nil {
					return err
				}
				list[i] = v
			}
			return nil
		}
		if !last {
			return at(child, segs[1:])
		}
		v, err := op(child)
		if err != nil {
			return err
		}
		obj[key] = v
		return nil
	}
	for _, p := range paths {
		if p == "" {
			continue
		}
		if err := at(data, strings.Split(p, ".")); err != nil {
			return err
		}
	}
	return nil
}

// sdkProtect is the Go SDK's gdpr.Protect: json.Marshal of each value, then
// the cipher.
func sdkProtect(data map[string]any, paths []string, c *sdkCipher) error {
	return sdkFields(data, paths, func(v any) (any, error) {
		plain, err := json.Marshal(v)
		if err != nil {
			return nil, err
		}
		return c.Encrypt(plain)
	})
}

// sdkUnprotect is the SDKs' Unprotect: a string is decrypted and decoded,
// anything else left as it is.
func sdkUnprotect(data map[string]any, paths []string, c *sdkCipher) error {
	return sdkFields(data, paths, func(v any) (any, error) {
		s, ok := v.(string)
		if !ok {
			return v, nil
		}
		plain, err := c.Decrypt(s)
		if err != nil {
			return nil, err
		}
		var out any
		return out, json.Unmarshal(plain, &out)
	})
}

// deepCopy copies a JSON value, so that protecting the copy leaves the
// original cleartext.
func deepCopy(t testing.TB, v map[string]any) map[string]any {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	var out map[string]any
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatal(err)
	}
	return out
}

// send is what a producer sends: count copies of a message with
// cleartext data, each protected anew, as a producer's retries are.
type send struct {
	Data  map[string]any `json:"data"`
	Count int            `json:"count"`
}

// sdkProducer makes the envelopes of sends (job urn, meta.id id, fields
// at paths encrypted under key), in order.
type sdkProducer func(t testing.TB, key []byte, urn, id, queue string, paths []string, sends ...send) [][]byte

// goProducer is the Go SDK's producer: Make, Protect, Encode.
func goProducer(t testing.TB, key []byte, urn, id, queue string, paths []string, sends ...send) [][]byte {
	t.Helper()
	c := newSDKCipher(t, key)
	var out [][]byte
	for _, s := range sends {
		for range s.Count {
			d := deepCopy(t, s.Data)
			if err := sdkProtect(d, paths, c); err != nil {
				t.Fatal(err)
			}
			e, err := envelope.New(urn, d, envelope.WithID(id), envelope.WithQueue(queue))
			if err != nil {
				t.Fatal(err)
			}
			b, err := e.Marshal()
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, b)
		}
	}
	return out
}

// python finds an interpreter that can run the Python producer (Python 3
// with the cryptography package). Without one the test is skipped, or
// fails under CI, whose .ci/run installs it.
var python = sync.OnceValues(func() (string, error) {
	var tried []string
	for _, bin := range []string{"python3", "/usr/bin/python3"} {
		path, err := exec.LookPath(bin)
		if err != nil {
			tried = append(tried, bin+": not found")
			continue
		}
		// The interpreter itself, not a launcher in front of it (pyenv's
		// shim takes seconds to start on a loaded machine).
		out, err := exec.Command(path, "-c", "import sys, cryptography; print(sys.executable)").CombinedOutput()
		if err != nil {
			tried = append(tried, fmt.Sprintf("%s: %v %s", path, err, bytes.TrimSpace(out)))
			continue
		}
		if exe := string(bytes.TrimSpace(out)); exe != "" {
			return exe, nil
		}
		return path, nil
	}
	return "", fmt.Errorf("no Python 3 with the cryptography package (%s)", strings.Join(tried, "; "))
})

func requirePython(t testing.TB) string {
	t.Helper()
	bin, err := python()
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("%v [CI is set, and .ci/run installs python3-cryptography: failing instead of skipping]", err)
		}
		t.Skipf("the Python producer needs it: %v (apt-get install python3-cryptography)", err)
	}
	return bin
}

// pythonProducer is the Python SDK's producer (testdata/sdk_gdpr_producer.py).
func pythonProducer(t testing.TB, key []byte, urn, id, queue string, paths []string, sends ...send) [][]byte {
	t.Helper()
	bin := requirePython(t)
	count := 0
	for _, s := range sends {
		count += s.Count
	}
	req, err := json.Marshal(map[string]any{"key": hex.EncodeToString(key), "urn": urn, "id": id, "queue": queue,
		"paths": paths, "sends": sends})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, filepath.Join("testdata", "sdk_gdpr_producer.py"))
	cmd.Stdin = bytes.NewReader(req)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("the Python producer: %v\n%s", err, stderr.String())
	}
	var bodies [][]byte
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		bodies = append(bodies, bytes.Clone(sc.Bytes()))
	}
	if len(bodies) != count {
		t.Fatalf("the Python producer printed %d envelopes, want %d:\n%s", len(bodies), count, out)
	}
	return bodies
}

// redisDump returns every key matching pattern with what it holds, as text.
func redisDump(t testing.TB, client redis.UniversalClient, pattern string) string {
	t.Helper()
	ctx := context.Background()
	keys, err := client.Keys(ctx, pattern).Result()
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	for _, k := range keys {
		typ, err := client.Type(ctx, k).Result()
		if err != nil {
			t.Fatal(err)
		}
		var v any
		switch typ {
		case "string":
			v, err = client.Get(ctx, k).Result()
		case "hash":
			v, err = client.HGetAll(ctx, k).Result()
		case "list":
			v, err = client.LRange(ctx, k, 0, -1).Result()
		case "set":
			v, err = client.SMembers(ctx, k).Result()
		case "zset":
			v, err = client.ZRangeWithScores(ctx, k, 0, -1).Result()
		case "stream":
			v, err = client.XRange(ctx, k, "-", "+").Result()
		case "none":
			continue
		default:
			t.Fatalf("key %s: type %s not dumped", k, typ)
		}
		if err != nil && !errors.Is(err, redis.Nil) {
			t.Fatal(err)
		}
		fmt.Fprintf(&b, "%s (%s): %v\n", k, typ, v)
	}
	return b.String()
}
