package idempotency_test

import (
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/testkit/conformance"
)

// FuzzMiddleware delivers any body twice and checks that every delivery gets
// one of the decisions the package documentation lists, never a panic:
//   - no usable identity: the handler runs both times (fail open);
//   - unsupported schema or unusable id: both rejected, permanently, and the
//     handler never runs;
//   - otherwise: the handler runs once and the second delivery is skipped.
func FuzzMiddleware(f *testing.F) {
	conformance.AddFixtureSeeds(f)
	for _, s := range []string{
		``, `{}`, `null`, `[]`, `{"meta":{"id":"a"}}`, `{"meta":{"id":"  "}}`, `{"meta":{"id":"a","schema_version":2}}`,
		"{\"meta\":{\"id\":\"a\xff\"}}", `{"meta":{"id":"a\u0000b"}}`, `{"meta":{"id":"` + strings.Repeat("é", 200) + `"}}`,
		`{"meta":{"id":"a","created_at":1e400},"data":[[[[{}]]]]}`, `{"meta":{"id":"a"},"meta":{"id":"b","schema_version":1.0}}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, payload []byte) {
		runs := 0
		h := idempotency.Middleware(memstore.New())(func(*message.Message) ([]*message.Message, error) {
			runs++
			return nil, nil
		})
		_, err1 := h(msgOf(payload))
		_, err2 := h(msgOf(payload))

		id, readErr := envelope.ReadIdentity(payload)
		switch {
		case readErr != nil || (!id.HasSchemaVersion || id.SchemaVersion == 1) && strings.TrimSpace(id.ID) == "":
			if err1 != nil || err2 != nil || runs != 2 {
				t.Fatalf("fail-open body: runs=%d errs=%v,%v", runs, err1, err2)
			}
		case id.HasSchemaVersion && id.SchemaVersion != 1, idempotency.ValidateID(id.ID) != nil:
			if !idempotency.IsPermanent(err1) || !idempotency.IsPermanent(err2) || runs != 0 {
				t.Fatalf("rejected body: runs=%d errs=%v,%v", runs, err1, err2)
			}
		default:
			if err1 != nil || err2 != nil || runs != 1 {
				t.Fatalf("identified body: runs=%d errs=%v,%v, want one run and one skip", runs, err1, err2)
			}
		}
	})
}
