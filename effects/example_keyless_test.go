package effects_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"

	"github.com/babelqueue/watermill-idempotency/effects"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
)

// A provider that ignores idempotency keys. The call sends the provider
// key under a header name of the provider's own (here for its logs), never
// as Idempotency-Key or X-Idempotency-Key, and sets GetBody to nil: with
// either of those headers and a body it can rewind, Go's http.Transport
// sends the POST again on its own when a reused connection dies before the
// reply, a second charge no effect record saw. So a lost reply comes back
// to Do as an error, and the effect is reconciled (Park, the default)
// instead of charged twice.
func Example_providerWithoutKeys() {
	var charges atomic.Int32
	provider := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		charges.Add(1) // it charges every request it gets: keys mean nothing to it
		fmt.Println("provider got", r.Header.Get("X-Charge-Reference") != "", r.Header.Get("Idempotency-Key") != "")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "ch_1")
	}))
	defer provider.Close()

	fx, err := effects.New(memstore.NewEffects())
	if err != nil {
		panic(err)
	}
	defer fx.Close()
	charge := fx.Effect("charge") // Park: an unknown outcome is reconciled, never resubmitted

	call := func(ctx context.Context, key string) (effects.Outcome, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, provider.URL, strings.NewReader(`{"amount_cents":1299}`))
		if err != nil {
			return effects.Outcome{}, err
		}
		req.Header.Set("X-Charge-Reference", key) // not Idempotency-Key nor X-Idempotency-Key
		req.GetBody = nil                         // and net/http cannot rewind the body to resend it
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return effects.Outcome{}, err // unknown: Do records it so, and reconciles before acting again
		}
		defer resp.Body.Close()
		id, err := io.ReadAll(resp.Body)
		if err != nil {
			return effects.Outcome{}, err
		}
		return effects.Succeeded(id), nil
	}

	ctx := idempotency.ContextWithDelivery(context.Background(), idempotency.Delivery{
		Key: idempotency.Key("billing", "order-1042"), Scope: "billing", ID: "order-1042"})
	id, err := charge.Do(ctx, map[string]int{"amount_cents": 1299}, call)
	fmt.Println(string(id), err, "- charges:", charges.Load())
	// Output:
	// provider got true false
	// ch_1 <nil> - charges: 1
}
