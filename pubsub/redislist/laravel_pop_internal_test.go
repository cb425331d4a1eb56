package redislist

import (
	"bytes"
	"context"
	"encoding/base64"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestLaravelPopEditsBytesAsGoDoes runs the pop script on real Redis over
// values of every shape and holds its reserved member to what the Go side
// computes: for a Laravel job (isLaravelJob), the job with bumpAttempts'
// edits and the token first (withMember), or in place of a token the job
// already carried; for anything else, a wrapper whose body is the value.
// Each value leaves the ready list only with its reservation written.
func TestLaravelPopEditsBytesAsGoDoes(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	ctx := context.Background()
	prefix := "bqtest:" + testenv.RandomHex(6) + ":"
	ready, reserved, notify := prefix+"q", prefix+"q:reserved", prefix+"q:notify"
	t.Cleanup(func() { client.Del(context.Background(), ready, reserved, notify) })

	values := []string{
		`{"attempts":0}`,
		`{"job":"x","attempts":41,"data":{"attempts":7,"s":"\"attempts\":1"}}`,
		` { "attempts" : 9 , "z" : [ {}, [] ] } `,
		"{\n\t\"attempts\":\r\n1}",
		`{"att\u0065mpts":9,"\u00e9":"\u00e9"}`,
		`{"attempts":1,"attempts":2}`,
		`{"attempts":-1}`, `{"attempts":-10}`, `{"attempts":-0}`, `{"attempts":99}`, `{"attempts":999999999999999999}`,
		`{"attempts":9223372036854775806}`, `{"attempts":9223372036854775807}`, `{"attempts":9223372036854775808}`,
		`{"attempts":-9223372036854775808}`, `{"attempts":-9223372036854775809}`,
		`{"attempts":1.0}`, `{"attempts":1e2}`, `{"attempts":"1"}`, `{"attempts":null}`, `{"attempts":01}`,
		`{"a":1e400,"attempts":0,"b":[1e-400,-1e400]}`,
		`{"id":1790000000000000001,"lines":[],"m":{},"n":1.10,"s":"caf\u00e9 \/ \\ \""}`,
		`{"id":1790000000000000001,"lines":[],"m":{},"n":1.10,"s":"caf\u00e9 \/ \\ \"","attempts":3}`,
		`{"__bq_reservation":"0123456789abcdef","attempts":2,"x":1}`,
		`{"x":1,"__bq_reservation":"0123456789abcdef","attempts":2}`,
		`{"__bq_reserv\u0061tion":"old","attempts":2}`,
		`{"attempts":1} {}`, `{"attempts":1},`, `{"attempts":1`, `{"attempts":1,}`, `{"attempts":0x10}`,
		`{}`, `[]`, `[1,2]`, `"attempts"`, `1`, `null`, ``, `a`, "\x00\xff\xfe", `{"attempts":1,"bad":"\x01"}`,
	}
	// Nested deeper than Lua's JSON library reads (1,000 levels), which
	// Laravel's own pop cannot take either: reserved wrapped.
	deep := `{"attempts":0,"deep":` + strings.Repeat("[", 1200) + strings.Repeat("]", 1200) + `}`
	values = append(values, deep)
	for _, value := range values {
		if err := client.RPush(ctx, ready, value).Err(); err != nil {
			t.Fatal(err)
		}
		token := newToken()
		res, err := laravelPopScript.Run(ctx, client, []string{ready, reserved, notify}, time.Now().Unix()+60, token, LaravelReservationKey, FrameKey, FrameBodyBase64Key).Slice()
		if err != nil {
			t.Fatalf("pop of %q: %v", value, err)
		}
		job, _ := res[0].(string)
		member, _ := res[1].(string)
		if job != value {
			t.Fatalf("pop of %q returned the job %q", value, job)
		}
		if left := client.LLen(ctx, ready).Val(); left != 0 {
			t.Fatalf("pop of %q left %d values on the ready list", value, left)
		}
		if got := client.ZRange(ctx, reserved, 0, -1).Val(); len(got) != 1 || got[0] != member {
			t.Fatalf("pop of %q: reserved set %q, want only %q", value, got, member)
		}
		want := laravelReservedMember([]byte(value), token)
		if value == deep {
			want = wrapped([]byte(value), token)
		}
		if member != string(want) {
			t.Errorf("pop of %q reserved\n%q\nwant\n%q", value, member, want)
		}
		client.Del(ctx, reserved)
	}
}

// laravelReservedMember is what the pop script must reserve for value, as
// the Go side of the package reads and edits a Laravel job.
func laravelReservedMember(value []byte, token string) []byte {
	quoted := strconv.AppendQuote(nil, token)
	bumped, ok := bumpAttempts(value)
	if !ok {
		return wrapped(value, token)
	}
	ms, _ := members(bumped)
	if slices.ContainsFunc(ms, func(m member) bool { return m.name == LaravelReservationKey }) { // a token already: replaced in place
		var spans []span
		for _, m := range ms {
			if m.name == LaravelReservationKey {
				spans = append(spans, span{start: m.start, end: m.end, text: quoted})
			}
		}
		return splice(bumped, spans)
	}
	return withMember(bumped, LaravelReservationKey, quoted)
}

func wrapped(value []byte, token string) []byte {
	var b bytes.Buffer
	b.WriteString(`{"` + LaravelReservationKey + `":"` + token + `","attempts":1,"` + FrameKey + `":1,"` + FrameBodyBase64Key + `":"`)
	b.WriteString(base64.StdEncoding.EncodeToString(value))
	b.WriteString(`"}`)
	return b.Bytes()
}
