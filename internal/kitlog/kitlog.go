// Package kitlog is how the kit's packages log when the user gave them no
// logger: through the standard library's default slog logger, read at each
// line (so that a slog.SetDefault made after the middleware was built
// applies), at the level the line deserves, warnings included.
//
// A package keeps a watermill.LoggerAdapter (the user's, or Default()) and
// logs warnings with Warn: on Default() they are slog warnings; on an
// adapter of the user's, which has no warning level, they go to its Error.
package kitlog

import (
	"context"
	"log/slog"
	"sort"

	"github.com/ThreeDotsLabs/watermill"
)

// Default returns the logger of a package given none: slog.Default(), read
// at each line.
func Default() watermill.LoggerAdapter { return slogDefault{} }

// Or returns l, or Default() when l is nil.
func Or(l watermill.LoggerAdapter) watermill.LoggerAdapter {
	if l == nil {
		return Default()
	}
	return l
}

// Silent reports whether l discards everything (the user asked for
// silence with watermill.NopLogger).
func Silent(l watermill.LoggerAdapter) bool {
	switch l.(type) {
	case watermill.NopLogger, *watermill.NopLogger:
		return true
	}
	return false
}

// Warn logs a warning: at slog.LevelWarn on Default(), through Error on
// any other adapter (Watermill's adapters have no warning level).
func Warn(l watermill.LoggerAdapter, msg string, err error, fields watermill.LogFields) {
	if d, ok := l.(slogDefault); ok {
		d.log(slog.LevelWarn, msg, err, fields)
		return
	}
	l.Error(msg, err, fields)
}

// DebugEnabled reports whether a debug line on l may be written, so that a
// caller can skip building its fields. It is true for any adapter but
// Default() and NopLogger, which cannot tell.
func DebugEnabled(l watermill.LoggerAdapter) bool {
	switch l.(type) {
	case slogDefault:
		return slog.Default().Enabled(context.Background(), slog.LevelDebug)
	case watermill.NopLogger, *watermill.NopLogger:
		return false
	}
	return true
}

// slogDefault is a watermill.LoggerAdapter writing to slog.Default() at the
// time of each line.
type slogDefault struct {
	fields watermill.LogFields // from With
}

func (s slogDefault) Error(msg string, err error, fields watermill.LogFields) {
	s.log(slog.LevelError, msg, err, fields)
}

func (s slogDefault) Info(msg string, fields watermill.LogFields) {
	s.log(slog.LevelInfo, msg, nil, fields)
}

func (s slogDefault) Debug(msg string, fields watermill.LogFields) {
	s.log(slog.LevelDebug, msg, nil, fields)
}

func (s slogDefault) Trace(msg string, fields watermill.LogFields) {
	s.log(watermill.LevelTrace, msg, nil, fields)
}

func (s slogDefault) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return slogDefault{fields: s.fields.Add(fields)}
}

func (s slogDefault) log(level slog.Level, msg string, err error, fields watermill.LogFields) {
	logger := slog.Default()
	ctx := context.Background()
	if !logger.Enabled(ctx, level) {
		return
	}
	attrs := make([]slog.Attr, 0, len(s.fields)+len(fields)+1)
	attrs = appendSorted(attrs, s.fields)
	attrs = appendSorted(attrs, fields)
	if err != nil {
		attrs = append(attrs, slog.String("error", err.Error()))
	}
	logger.LogAttrs(ctx, level, msg, attrs...)
}

// appendSorted appends fields in the order of their names, so that a line
// reads the same every time.
func appendSorted(attrs []slog.Attr, fields watermill.LogFields) []slog.Attr {
	if len(fields) == 0 {
		return attrs
	}
	names := make([]string, 0, len(fields))
	for k := range fields {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		attrs = append(attrs, slog.Any(k, fields[k]))
	}
	return attrs
}
