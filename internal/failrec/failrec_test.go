package failrec_test

import (
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/internal/failrec"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// TestValueRoundTrip: a failing and an ended record read back as written,
// markers with the layout's own separators included; a damaged value keeps
// its state without a count, never a wrong one.
func TestValueRoundTrip(t *testing.T) {
	at := time.UnixMilli(1_767_225_600_123)
	for _, f := range []stores.Failure{
		{Attempts: 3, FirstFailure: at, NotBefore: at.Add(time.Second)},
		{Attempts: 1, FirstFailure: at, End: &stores.End{Reason: "failed", At: at, Topic: "orders.dlq", Marker: ""}},
		{Attempts: 7, FirstFailure: at, End: &stores.End{Reason: "conflict", At: at, Marker: `12:e3:{"n":9}`}},
	} {
		v := failrec.Value(42, f)
		r := failrec.Parse(v)
		want := stores.StateFailing
		if f.End != nil {
			want = stores.StateEnded
		}
		g := r.Failure
		switch {
		case r.State != want, r.Fingerprint != 42, g.Attempts != f.Attempts, !g.FirstFailure.Equal(f.FirstFailure), !g.NotBefore.Equal(f.NotBefore):
			t.Fatalf("Parse(%q) = %+v, want %v of %+v", v, r, want, f)
		case f.End != nil && (g.End == nil || *g.End != stores.End{Reason: f.End.Reason, At: g.End.At, Topic: f.End.Topic, Marker: f.End.Marker} || !g.End.At.Equal(f.End.At)):
			t.Fatalf("Parse(%q).End = %+v, want %+v", v, g.End, f.End)
		}
		if f.End != nil && v[:len(failrec.EndedPrefix(f.End.Marker))] != failrec.EndedPrefix(f.End.Marker) {
			t.Fatalf("%q does not start with EndedPrefix(%q)", v, f.End.Marker)
		}
	}
	for _, bad := range []string{"e", "e9:x{}", "ex:{}", "f{not json", "e-1:{}"} {
		r := failrec.Parse(bad)
		if r.Failure.Attempts != 0 || (r.State != stores.StateFailing && r.State != stores.StateEnded) {
			t.Fatalf("Parse(%q) = %+v, want its state without a count", bad, r)
		}
	}
	if _, ok := failrec.ParseCountClaim("k1:0:99:cshort"); ok {
		t.Fatal("a claim that carries a count with a holder longer than the value parsed")
	}
	c, ok := failrec.ParseCountClaim("k5:0:6:cowner" + failrec.Value(0, stores.Failure{Attempts: 2}))
	if !ok || c.Lease != 5 || c.Holder != "cowner" || c.InFlight().State != stores.StateInFlight || c.InFlight().Failure.Attempts != 2 {
		t.Fatalf("ParseCountClaim = %+v, %v", c, ok)
	}
	if r := failrec.LookupCount("k5:10:6:cowner"+failrec.Value(0, stores.Failure{Attempts: 2}), 20); r.State != stores.StateUnknown {
		t.Fatalf("a claim past its lease whose count expired reads %+v, want unknown", r)
	}
}
