package httpidempotency

import (
	"encoding/json"
	"net/http"
	"strconv"
	"time"
)

// DefaultProblemBase starts the "type" of every problem the middleware
// answers with (RFC 9457 problem details): the base followed by one of the
// Problem* names, a section of the kit's documentation. WithProblemBase
// points them at your own API's documentation instead.
const DefaultProblemBase = "https://github.com/babelqueue/watermill-idempotency/blob/main/docs/api-idempotency.md#"

// The problems the middleware answers with, by the name that ends their
// "type" (see DefaultProblemBase).
const (
	ProblemKeyMissing        = "key-missing"        // 400: the operation needs an Idempotency-Key
	ProblemKeyInvalid        = "key-invalid"        // 400: the key cannot be used (size, characters, several headers)
	ProblemBodyTooLarge      = "body-too-large"     // 413: the request body is over Operation.MaxRequestBody
	ProblemKeyReused         = "key-reused"         // 422: the key was used for another request (another intent)
	ProblemKeyExpired        = "key-expired"        // 422: the key's saved response is past Operation.ExpiresAfter (ExpiredReject)
	ProblemInProgress        = "in-progress"        // 409: a request with this key is still running; Retry-After says when to look again
	ProblemReplayForbidden   = "replay-forbidden"   // 403: the caller may not see the saved response (Operation.Authorize)
	ProblemNoTenant          = "no-tenant"          // 401: the tenant function found no tenant for the caller
	ProblemResponseTooLarge  = "response-too-large" // 500: the response was over the size a record keeps
	ProblemRecordUnreadable  = "record-unreadable"  // 500: the record holds no saved response this version reads
	ProblemStoreUnavailable  = "store-unavailable"  // 503: the store could not be read or written; nothing ran, or nothing committed
	ProblemHandlerFailed     = "handler-failed"     // 500: a transactional handler returned an error; nothing committed
	ProblemTenantUnusable    = "tenant-unusable"    // 500: the tenant function returned a tenant with control characters or over MaxKeyBytes
	ProblemTransactionFailed = "transaction-failed" // 503: the transaction kept conflicting, or its commit failed; nothing committed
)

// problemBody is an RFC 9457 problem details object.
type problemBody struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail,omitempty"`
}

// problem answers with an application/problem+json body, and Retry-After
// when retryAfter is positive (in whole seconds, at least one).
func (g *Guard) problem(w http.ResponseWriter, status int, name, title, detail string, retryAfter time.Duration) {
	h := w.Header()
	h.Set("Content-Type", "application/problem+json")
	h.Set("Cache-Control", "no-store")
	if retryAfter > 0 {
		h.Set("Retry-After", strconv.Itoa(retrySeconds(retryAfter)))
	}
	body, _ := json.Marshal(problemBody{Type: g.cfg.problemBase + name, Title: title, Status: status, Detail: detail})
	w.WriteHeader(status)
	_, _ = w.Write(append(body, '\n'))
}

// retrySeconds rounds d up to whole seconds, at least one.
func retrySeconds(d time.Duration) int {
	s := int((d + time.Second - 1) / time.Second)
	if s < 1 {
		s = 1
	}
	return s
}
