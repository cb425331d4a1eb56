package main

import (
	"encoding/json"
	"errors"
	"flag"
	"io"
	"strings"
	"time"
)

// The exit statuses, listed in help.
const (
	exitOK      = 0 // the command did all it was asked
	exitFailure = 1 // it failed, or stopped on an error
	exitUsage   = 2 // bad usage: nothing was done
	exitPartial = 3 // it finished, but did not do all it was asked (the output says what)
)

// exitStatuses is the list help prints.
const exitStatuses = "Exit status:\n" +
	"  0  success\n" +
	"  1  failure: the command failed, or stopped on an error (a redrive that stopped\n" +
	"     part way reports what it moved before it stopped)\n" +
	"  2  bad usage: an unknown command or flag, a missing or invalid value; nothing was done\n" +
	"  3  partial: the command finished but not all of it could be done: redrive left\n" +
	"     messages it selected on the dead-letter topic (the broker refused them, they\n" +
	"     have no queue to go to, or they failed again after the run sent them back),\n" +
	"     forget found no record for some ids, effects resolve could not resolve some\n" +
	"     effects (none, final already, or in flight without --force), effects show\n" +
	"     found no effect for some keys\n"

// outputFormat is the --output flag: text (tables for people) or json (one
// JSON document for scripts).
type outputFormat string

const (
	outputText outputFormat = "text"
	outputJSON outputFormat = "json"
)

func (o *outputFormat) String() string { return string(*o) }

func (o *outputFormat) Set(v string) error {
	switch outputFormat(v) {
	case outputText, outputJSON:
		*o = outputFormat(v)
		return nil
	}
	return errors.New("want text or json")
}

// registerOutput adds --output to fs; its value is text until set.
func registerOutput(fs *flag.FlagSet) *outputFormat {
	o := outputText
	fs.Var(&o, "output", "`format` of standard output: text (tables) or json (one JSON object on one line,\n"+
		"written when the command ends; its fields are listed below)")
	return &o
}

// writeJSON writes v as one JSON document and a newline.
func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false)
	return enc.Encode(v)
}

// jsonTime is a time as RFC 3339 in UTC, or null when zero.
func jsonTime(t time.Time) *string {
	if t.IsZero() {
		return nil
	}
	s := t.UTC().Format(time.RFC3339Nano)
	return &s
}

// jsonShapes describe each command's --output json document, for its help
// (and the package doc, which says the same).
var jsonShapes = map[string]string{
	"redrive": `{"from", "dry_run", "read", "moved", "would_move" (a dry run: it moves nothing), "kept",
 "not_moved", "skipped", "unknown_age", "emptied", "error" (when it stopped on one),
 "messages" (with --verbose): [{"id", "urn", "reason", "from", "to", "moved", "would_move", "note"}]}`,
	"inspect": `{"records": [{"id", "state" (remembered, in_flight, failing, ended or unknown), "expires_at",
 "attempts", "first_failure" (failing and ended messages: their failed runs),
 "end" (ended: {"reason", "at", "topic", "redrive_mark"}),
 "response" (API records: {"status", "bytes", "body_kept", "saved_at",
 "reference" (identity records of two tiers)})}], "unknown"}`,
	"forget": `{"forgotten", "requested", "missing": [the ids with no record]}`,
	"effects list": `{"effects": [{"provider_key", "state", "lease" (live, landing, lapsed or none),
 "lease_until" (the lease's end, null for none), "lease_lapsed", "state_since", "age_seconds",
 "attempts", "effect", "handler", "message_id", "evidence", "note", "result_dropped",
 "result_expires_at"}], "more" (more match than --limit showed)}`,
	"effects show": `{"effects": [{"provider_key", "state", "lease" (live, landing, lapsed or none),
 "lease_until", "holder", "effect", "handler", "message_id", "fingerprint", "attempts",
 "evidence", "note", "result" (succeeded: the provider's result as text; else null),
 "result_dropped", "result_expires_at", "created_at", "state_since", "updated_at",
 "expires_at"}], "missing": [the keys with no effect]}`,
}

// jsonHelp is the help's paragraph on a command's --output json, or ""
// for a command without it.
func jsonHelp(command string) string {
	shape, ok := jsonShapes[command]
	if !ok {
		return ""
	}
	return "\n--output json writes one JSON object (times RFC 3339 in UTC, or null; fields may be\n" +
		"added in later releases, none renamed or removed):\n  " + strings.ReplaceAll(shape, "\n", "\n  ") + "\n"
}
