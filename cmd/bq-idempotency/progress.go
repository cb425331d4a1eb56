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
//
// The rate is the run's own, from the first message dealt with to the
// last: what the run took to connect and to read its first message is not
// counted, and no rate is shown before there are two messages to measure
// it by.
type progress struct {
	mu                sync.Mutex
	w                 io.Writer
	total             int64
	verb, keptVerb    string
	read, moved, kept int64
	start             time.Time
	first, last       time.Time // when the first and the last message were dealt with
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
			// The rate and the time left are the description's (rateLocked):
			// the bar's own start at "0 msg/hr" and count the wait for the
			// first message.
			progressbar.OptionSetPredictTime(false),
			progressbar.OptionSetElapsedTime(false),
			progressbar.OptionSetRenderBlankState(true),
			progressbar.OptionSetWidth(30),
		)
		return p
	}
	p.stop, p.stopped = make(chan struct{}), make(chan struct{})
	go p.lines(interval)
	return p
}

// describe is the bar's description: what the run did so far, its rate
// and the time left at that rate once known.
func (p *progress) describe() string {
	s := fmt.Sprintf("redrive: %d %s, %d %s", p.moved, p.verb, p.kept, p.keptVerb)
	if rate := p.rateLocked(); rate > 0 {
		s += ", " + formatRate(rate)
		if left, ok := p.leftLocked(rate); ok {
			s += ", " + left + " left"
		}
	}
	return s
}

// rateLocked is the messages dealt with a second, from the first to the
// last; 0 before there are two.
func (p *progress) rateLocked() float64 {
	span := p.last.Sub(p.first).Seconds()
	if p.read < 2 || span <= 0 {
		return 0
	}
	return float64(p.read-1) / span
}

// leftLocked is the time left at rate, when the total is known.
func (p *progress) leftLocked(rate float64) (string, bool) {
	if p.total < 0 || rate <= 0 {
		return "", false
	}
	left := time.Duration(float64(p.total-p.read) / rate * float64(time.Second))
	if left < 10*time.Second {
		return left.Round(100 * time.Millisecond).String(), true
	}
	return left.Round(time.Second).String(), true
}

// formatRate writes a rate of messages a second, to a tenth below 100.
func formatRate(rate float64) string {
	if rate < 100 {
		return fmt.Sprintf("%.1f msg/s", rate)
	}
	return fmt.Sprintf("%.0f msg/s", rate)
}

// add counts one message dealt with (redrive.WithProgress).
func (p *progress) add(e redrive.Entry) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.read++
	p.last = p.now()
	if p.read == 1 {
		p.first = p.last
	}
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
		p.drawLocked()
	}
}

// drawLocked redraws the bar: its description, then its count, which
// renders both of one moment.
func (p *progress) drawLocked() {
	p.drawn = p.now()
	p.bar.Describe(p.describe())
	_ = p.bar.Set64(p.read)
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
	if rate := p.rateLocked(); rate > 0 {
		s += ", " + formatRate(rate)
		if left, ok := p.leftLocked(rate); ok {
			s += ", about " + left + " left"
		}
	}
	return s + fmt.Sprintf(", %v elapsed", elapsed.Round(time.Second))
}

// done stops the reports. The bar is drawn a last time with the final
// counts, and left on the terminal: at 100% when the run finished the
// topic (complete), which the total the broker gave at the start may
// have overcounted; as far as it got otherwise (an error, --max).
func (p *progress) done(complete bool) {
	if p.bar != nil {
		p.mu.Lock()
		defer p.mu.Unlock()
		shrink := complete && p.total > p.read && p.read > 0
		if shrink {
			p.total = p.read
		}
		p.drawLocked()
		if shrink {
			p.bar.ChangeMax64(p.total) // draws it full
		}
		_ = p.bar.Exit()
		fmt.Fprintln(p.w)
		return
	}
	close(p.stop)
	<-p.stopped
}
