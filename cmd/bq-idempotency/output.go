package main

import (
	"encoding/json"
	"errors"
	"flag"
	"io"
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
	"     messages it selected on the dead-letter topic (the broker refused them, or they\n" +
	"     have no queue to go to), forget found no record for some ids, effects resolve\n" +
	"     could not resolve some effects\n"

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
	fs.Var(&o, "output", "`format` of standard output: text (tables) or json (one JSON object, written\n"+
		"when the command ends, with the field names listed in the package doc)")
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
