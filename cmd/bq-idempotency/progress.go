package main

import (
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/schollz/progressbar/v3"

	"github.com/babelqueue/watermill-idempotency/redrive"
)

// progress reports a redrive run on standard error as it goes: on a
// terminal a bar redrawn in place (read of total, moved, kept, rate, time
// left), otherwise a status line every interval, for logs. total is the
// number of messages the dead-letter topic held when the run began, -1
// when the broker cannot tell.
type progress struct {
	mu                sync.Mutex
	w                 io.Writer
	total             int64
	verb, keptVerb    string
	read, moved, kept int64
	start             time.Time
	now               func() time.Time
	bar               *progressbar.ProgressBar // on a terminal
	stop, stopped     chan struct{}            // the status lines' ticker
	lastLine          int64
	drawn             time.Time // when the bar was last redrawn
}

func newProgress(w io.Writer, terminal, dryRun bool, total int64, interval time.Duration) *progress {
	p := &progress{w: w, total: total, verb: "moved", keptVerb: "kept", start: time.Now(), now: time.Now}
	if dryRun {
		p.verb, p.keptVerb = "would move", "would stay"
	}
	if terminal {
		p.bar = progressbar.NewOptions64(total,
			progressbar.OptionSetWriter(w),
			progressbar.OptionSetDescription(p.describe()),
			progressbar.OptionShowCount(),
			progressbar.OptionShowIts(),
			progressbar.OptionSetItsString("msg"),
			progressbar.OptionSetPredictTime(true),
			progressbar.OptionSetElapsedTime(true),
			progressbar.OptionSetRenderBlankState(true),
			progressbar.OptionClearOnFinish(),
			progressbar.OptionSetWidth(30),
		)
		return p
	}
	p.stop, p.stopped = make(chan struct{}), make(chan struct{})
	go p.lines(interval)
	return p
}

// describe is the bar's description: what the run did so far.
func (p *progress) describe() string {
	return fmt.Sprintf("redrive: %d %s, %d %s", p.moved, p.verb, p.kept, p.keptVerb)
}

// add counts one message dealt with (redrive.WithProgress).
func (p *progress) add(e redrive.Entry) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.read++
	if e.Moved {
		p.moved++
	} else {
		p.kept++
	}
	if p.total >= 0 && p.read > p.total {
		p.total = p.read // more came in since the run began
		if p.bar != nil {
			p.bar.ChangeMax64(p.total)
		}
	}
	// The bar is redrawn at most every barEvery, and then twice (its
	// count, then the description): it shows the count and moved and kept
	// of one moment.
	if p.bar != nil && (p.read == 1 || p.now().Sub(p.drawn) >= barEvery) {
		p.drawn = p.now()
		_ = p.bar.Set64(p.read)
		p.bar.Describe(p.describe())
	}
}

// barEvery is how often the bar is redrawn at most.
const barEvery = 100 * time.Millisecond

// lines writes a status line every interval in which messages came, until
// done.
func (p *progress) lines(interval time.Duration) {
	defer close(p.stopped)
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-p.stop:
			return
		case <-t.C:
			p.mu.Lock()
			if p.read != p.lastLine { // nothing new: say nothing
				p.lastLine = p.read
				fmt.Fprintln(p.w, p.statusLocked())
			}
			p.mu.Unlock()
		}
	}
}

// statusLocked is one status line: read (of total), moved, kept, the rate
// so far and the time left at that rate.
func (p *progress) statusLocked() string {
	elapsed := p.now().Sub(p.start)
	s := fmt.Sprintf("redrive: %d", p.read)
	if p.total >= 0 {
		s += fmt.Sprintf(" of %d", p.total)
	}
	s += fmt.Sprintf(" read, %d %s, %d %s", p.moved, p.verb, p.kept, p.keptVerb)
	if elapsed <= 0 || p.read == 0 {
		return s
	}
	rate := float64(p.read) / elapsed.Seconds()
	s += fmt.Sprintf(", %.1f msg/s", rate)
	if p.total >= 0 {
		left := time.Duration(float64(p.total-p.read) / rate * float64(time.Second))
		if left < 10*time.Second {
			left = left.Round(100 * time.Millisecond)
		} else {
			left = left.Round(time.Second)
		}
		s += fmt.Sprintf(", about %v left", left)
	}
	return s + fmt.Sprintf(", %v elapsed", elapsed.Round(time.Second))
}

// done stops the reports: the bar is cleared from the terminal.
func (p *progress) done() {
	if p.bar != nil {
		p.mu.Lock()
		defer p.mu.Unlock()
		_ = p.bar.Exit()
		_ = p.bar.Clear()
		return
	}
	close(p.stop)
	<-p.stopped
}
