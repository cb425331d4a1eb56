package envelope_test

import (
	"fmt"
	"time"

	"github.com/babelqueue/watermill-idempotency/envelope"
)

// A producer builds an envelope and sends its bytes as the message payload.
// Services in other languages read the same JSON; meta.id is the identity
// every consumer deduplicates on.
func Example() {
	e, err := envelope.New("urn:babel:orders:placed", map[string]any{"order_id": 1042},
		envelope.WithID("order-1042-placed"),
		envelope.WithTraceID("trace-7"),
		envelope.WithQueue("orders"),
		envelope.WithCreatedAt(time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)))
	if err != nil {
		panic(err)
	}
	payload, err := e.Marshal()
	if err != nil {
		panic(err)
	}
	fmt.Println(string(payload))
	// Output:
	// {"job":"urn:babel:orders:placed","trace_id":"trace-7","data":{"order_id":1042},"meta":{"id":"order-1042-placed","queue":"orders","lang":"go","schema_version":1,"created_at":1767323045000},"attempts":0}
}

// A consumer reads the identity without decoding the body: what the
// idempotency middleware does on every delivery.
func ExampleReadIdentity() {
	payload := []byte(`{"job":"urn:babel:orders:placed","trace_id":"trace-7","data":{"order_id":1042},` +
		`"meta":{"id":"order-1042-placed","queue":"orders","lang":"php","schema_version":1,"created_at":1767323045000},"attempts":0}`)
	id, err := envelope.ReadIdentity(payload)
	if err != nil {
		panic(err)
	}
	fmt.Println(id.ID, id.SchemaVersion, time.UnixMilli(id.CreatedAt).UTC().Format(time.RFC3339))
	// Output:
	// order-1042-placed 1 2026-01-02T03:04:05Z
}

// Parse keeps fields it does not know, so a message passed on by a Go
// service loses nothing another language put in it.
func ExampleParse() {
	e, err := envelope.Parse([]byte(`{"job":"urn:babel:orders:placed","trace_id":"trace-7","data":{"order_id":1042},` +
		`"meta":{"id":"order-1042-placed","queue":"orders","lang":"php","schema_version":1,"created_at":1767323045000},` +
		`"attempts":2,"tenant":"acme"}`))
	if err != nil {
		panic(err)
	}
	tenant, _ := e.Extra("tenant")
	fmt.Println(e.Job, e.Meta.ID, e.Attempts, string(e.Data), string(tenant))
	// Output:
	// urn:babel:orders:placed order-1042-placed 2 {"order_id":1042} "acme"
}

// A message produced while handling another gets an id derived from its
// parent's, so a retry of the parent produces the same id and the
// downstream consumer skips the second copy.
func ExampleNewChild() {
	parent, _ := envelope.New("urn:babel:orders:placed", map[string]any{"order_id": 1042},
		envelope.WithID("order-1042-placed"), envelope.WithTraceID("trace-7"))
	first, _ := envelope.NewChild(parent, "invoice", "urn:babel:invoices:requested", map[string]any{"order_id": 1042})
	retried, _ := envelope.NewChild(parent, "invoice", "urn:babel:invoices:requested", map[string]any{"order_id": 1042})
	fmt.Println(first.Meta.ID == retried.Meta.ID, first.Meta.ID == envelope.DeriveID("order-1042-placed", "invoice"))
	fmt.Println(first.TraceID)
	// Output:
	// true true
	// trace-7
}

// The fingerprint is what tells a redelivery from a meta.id reused for
// another message: it covers job and data, whatever their key order, white
// space or number spelling, and ignores meta and attempts.
func ExampleFingerprint() {
	a, _ := envelope.Fingerprint([]byte(`{"job":"urn:babel:orders:placed","data":{"order_id":1042,"total":12.5},"meta":{"id":"x"},"attempts":0}`))
	b, _ := envelope.Fingerprint([]byte(`{"attempts":3,"meta":{"id":"x"},"data":{"total":1.25e1, "order_id":1042},"job":"urn:babel:orders:placed"}`))
	c, _ := envelope.Fingerprint([]byte(`{"job":"urn:babel:orders:placed","data":{"order_id":1043,"total":12.5},"meta":{"id":"x"},"attempts":0}`))
	fmt.Println("redelivery:", a == b)
	fmt.Println("other content:", a == c)
	// Output:
	// redelivery: true
	// other content: false
}
