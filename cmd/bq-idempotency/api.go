package main

import (
	"flag"
	"fmt"
	"time"

	"github.com/babelqueue/watermill-idempotency/middleware/httpidempotency"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// The API records of package httpidempotency are keyed by tenant,
// operation and the client's Idempotency-Key: --api-tenant and
// --operation name them, and the ids given are the keys.

func (a *storeArgs) registerAPI(fs *flag.FlagSet) {
	fs.StringVar(&a.apiTenant, "api-tenant", "", "the `tenant` of API records (package httpidempotency); with --operation, the ids\n"+
		"are Idempotency-Key values; not with --handler or the SDK layouts")
	fs.StringVar(&a.operation, "operation", "", "the `operation` of API records (its Operation.Name); with --api-tenant")
}

// api reports whether the ids name API records.
func (a *storeArgs) api() bool { return a.apiTenant != "" || a.operation != "" }

// checkAPI refuses API flags that do not go together.
func (a *storeArgs) checkAPI() error {
	switch {
	case !a.api():
		return nil
	case a.apiTenant == "" || a.operation == "":
		return usageErr("--api-tenant and --operation name an API record together: give both")
	case a.scope != "" || a.unscoped:
		return usageErr("--api-tenant and --operation exclude --handler and --unscoped")
	case a.sdk():
		return usageErr("API records are kept by the kit's stores (--store redis or postgres), not --store %s", a.kind)
	}
	for what, v := range map[string]string{"--api-tenant": a.apiTenant, "--operation": a.operation} {
		if err := idempotency.ValidateID(v); err != nil {
			return usageErr("%s: %v", what, err)
		}
	}
	return nil
}

// keyOf returns the store key of id: an API record's, or a message's.
func (a *storeArgs) keyOf(id string) string {
	if a.api() {
		return httpidempotency.RecordKey(a.apiTenant, a.operation, id)
	}
	return idempotency.Key(a.scope, id)
}

// savedResponse describes the response an API record keeps, for inspect.
func savedResponse(r stores.Record) string {
	if r.State != stores.StateRemembered {
		return "-"
	}
	resp, err := httpidempotency.DecodeResponse(r.Value)
	if id, ierr := httpidempotency.DecodeIdentity(r.Value); err != nil && ierr == nil {
		ref := ""
		if id.Reference != "" {
			ref = " " + id.Reference
		}
		return fmt.Sprintf("%d (identity record%s, saved %s; the full response is in the response store)", id.Status, ref, id.SavedAt.UTC().Format(time.RFC3339))
	}
	if err != nil {
		return "unreadable"
	}
	saved := ""
	if !resp.SavedAt.IsZero() {
		saved = ", saved " + resp.SavedAt.UTC().Format(time.RFC3339)
	}
	if resp.BodyNotKept {
		return fmt.Sprintf("%d (body not kept%s)", resp.Status, saved)
	}
	return fmt.Sprintf("%d (%d bytes%s)", resp.Status, len(resp.Body), saved)
}

// responseJSON is the saved response of an API record, in inspect's
// --output json.
type responseJSON struct {
	Status   int     `json:"status"`
	Bytes    int     `json:"bytes"`
	BodyKept bool    `json:"body_kept"`
	SavedAt  *string `json:"saved_at"`
	// Reference is the resource an identity record names (a Guard with
	// two tiers keeps the full response in its response store).
	Reference string `json:"reference,omitempty"`
}

// responseOf describes the response an API record keeps, for inspect's
// --output json: nil when it keeps none, a zero status when it cannot be
// read.
func responseOf(r stores.Record) *responseJSON {
	if r.State != stores.StateRemembered {
		return nil
	}
	resp, err := httpidempotency.DecodeResponse(r.Value)
	if id, ierr := httpidempotency.DecodeIdentity(r.Value); err != nil && ierr == nil {
		// An identity record (two tiers): no body here.
		return &responseJSON{Status: id.Status, SavedAt: jsonTime(id.SavedAt), Reference: id.Reference}
	}
	if err != nil {
		return &responseJSON{}
	}
	return &responseJSON{Status: resp.Status, Bytes: len(resp.Body), BodyKept: !resp.BodyNotKept, SavedAt: jsonTime(resp.SavedAt)}
}
