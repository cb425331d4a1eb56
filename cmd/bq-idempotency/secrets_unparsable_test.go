package main

import (
	"strings"
	"testing"
)

// TestSecretsInUnparsableURLsAreNeverPrinted: a password with a character
// the user did not percent-encode (a '%', a '#', a space) makes the URL
// unparsable. The command refuses it as a usage error, and must still not
// print the password it could not parse out.
func TestSecretsInUnparsableURLsAreNeverPrinted(t *testing.T) {
	t.Parallel()
	const secret = "s3cr3t%zzPw"
	for _, c := range []struct {
		env  []string
		args []string
	}{
		{nil, []string{"inspect", "--handler", "h", "--redis-url", "redis://:" + secret + "@127.0.0.1:1/0", "id-1"}},
		{nil, []string{"inspect", "--handler", "h", "--redis-url", "redis://user:" + secret + "@127.0.0.1:1/0", "id-1"}},
		{[]string{"REDIS_URL=redis://:" + secret + "@127.0.0.1:1/0"}, []string{"redrive", "--from", "x.dlq"}},
		{nil, []string{"redrive", "--from", "x.dlq", "--broker", "amqp", "--amqp-url", "amqp://guest:" + secret + "@127.0.0.1:1/"}},
		{nil, []string{"redrive", "--from", "x.dlq", "--broker", "postgres", "--postgres-dsn", "postgres://u:" + secret + "@127.0.0.1:1/db"}},
	} {
		r := cli(t, c.env, "", c.args...)
		if r.code == 0 {
			t.Errorf("%q: exit 0", c.args)
		}
		if strings.Contains(r.stdout+r.stderr, "s3cr3t") {
			t.Errorf("%q printed the password:\n%s%s", c.args, r.stdout, r.stderr)
		}
	}
}
