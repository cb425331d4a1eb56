package main

import (
	"bytes"
	"context"
	"io"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/creack/pty"

	"github.com/babelqueue/watermill-idempotency/envelope"
)

// Off a terminal (standard error is a pipe here), progress is a status
// line every --progress-every with the total the stream held, the rate and
// the time left, and no escape codes; standard output has the summary and
// no per-message table.
func TestProgressLinesOffATerminal(t *testing.T) {
	t.Parallel()
	d := newDeadLetters(t)
	for range 12 {
		d.add(envelope.ReasonFailed, time.Now().UnixMilli())
	}
	r := d.redrive("--rate", "20", "--progress-every", "150ms")
	if r.code != 0 || strings.ContainsAny(r.stdout+r.stderr, "\r\033") {
		t.Fatalf("exit %d, output %q %q", r.code, r.stdout, r.stderr)
	}
	line := regexp.MustCompile(`(?m)^redrive: (\d+) of 12 read, \d+ moved, 0 kept, [0-9.]+ msg/s, about [0-9.]+m?s left, \d+s elapsed$`)
	if len(line.FindAllString(r.stderr, -1)) < 2 {
		t.Fatalf("want status lines with the total, rate and time left every 150ms, got:\n%s", r.stderr)
	}
	t.Logf("stderr:\n%s", r.stderr)
	if strings.Contains(r.stdout, "URN") || !strings.Contains(r.stdout, "12 read, 12 moved, 0 kept") {
		t.Fatalf("want the summary alone on standard output:\n%s", r.stdout)
	}
	if r := d.redrive("--dry-run", "--progress-every", "10ms"); r.code != 0 || strings.ContainsAny(r.stderr, "\r\033") {
		t.Fatalf("dry run: exit %d, output %q %q", r.code, r.stdout, r.stderr)
	}
}

// On a terminal (a pty as standard error), progress is a bar redrawn in
// place: the count of the total, moved and kept, the rate; it is cleared
// at the end, and standard output (no terminal) has the summary.
func TestProgressBarOnATerminal(t *testing.T) {
	t.Parallel()
	d := newDeadLetters(t)
	for range 6 {
		d.add(envelope.ReasonFailed, time.Now().UnixMilli())
	}
	ptmx, tty, err := pty.Open()
	if err != nil {
		t.Skipf("no pty: %v", err)
	}
	defer ptmx.Close()
	const cols = 70 // narrower than the bar's default: it shrinks to fit
	if err := pty.Setsize(ptmx, &pty.Winsize{Cols: cols, Rows: 24}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary, "redrive", "--redis-url", redisURL(), "--from", d.dlq, "--idle", "300ms", "--rate", "10")
	var stdout bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, tty
	var term bytes.Buffer
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _, _ = io.Copy(&term, ptmx) }() // ends when the pty closes
	runErr := cmd.Run()
	_ = tty.Close()
	_ = ptmx.SetReadDeadline(time.Now().Add(5 * time.Second)) // the copy ends at EIO once no one holds the tty; this bounds it
	wg.Wait()
	if runErr != nil {
		t.Fatalf("%v\nterminal: %q\nstdout: %s", runErr, term.String(), stdout.String())
	}
	out := term.String()
	if !strings.Contains(out, "\r") || !strings.Contains(out, "redrive: ") || !strings.Contains(out, "/6") ||
		!strings.Contains(out, "moved") || !strings.Contains(out, "msg/s") {
		t.Fatalf("want a bar redrawn in place with the count of 6, moved and the rate; terminal: %q", out)
	}
	t.Logf("terminal: %q", out)
	for _, drawn := range strings.Split(out, "\r") {
		if n := utf8.RuneCountInString(strings.TrimRight(drawn, " \n")); n > cols {
			t.Errorf("a line of %d columns on a terminal of %d: %q", n, cols, drawn)
		}
	}
	if !strings.Contains(stdout.String(), "6 read, 6 moved, 0 kept") {
		t.Fatalf("stdout: %s", stdout.String())
	}
}
