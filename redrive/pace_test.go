package redrive

import (
	"testing"
	"time"
)

// TestPacerKeepsTheRate runs the pacer on a clock of the test's own: every
// move takes 40% of the interval (publish, ack, the next read), and every
// wait ends 70% of an interval late (a loaded machine's timers). The moves
// still come one interval apart on average, within one interval over the
// run (spacing each move an interval after the last one ended, as before,
// gave 2.1 intervals a move), and never ahead of their schedule. The first
// move is not delayed; a stall is made up for by a tenth of a second of
// moves only, and no window of k intervals holds more than that many
// moves beyond k.
func TestPacerKeepsTheRate(t *testing.T) {
	t.Parallel()
	const interval = 10 * time.Millisecond
	p := pacer{interval: interval}
	start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	if p.delay(start) != 0 {
		t.Fatal("the first move waited")
	}
	p = pacer{interval: interval}
	now := start
	var moves []time.Time
	move := func() {
		if wait := p.delay(now); wait > 0 {
			now = now.Add(wait + interval*7/10)
		}
		moves = append(moves, now)
		now = now.Add(interval * 4 / 10)
	}
	const n = 1000
	for range n {
		move()
	}
	if took, want := moves[n-1].Sub(moves[0]), (n-1)*interval; took < want || took > want+interval {
		t.Fatalf("%d moves took %v, want %v (one interval each) within one interval", n, took, want)
	}
	for i, at := range moves {
		if ahead := start.Add(time.Duration(i) * interval).Sub(at); ahead > 0 {
			t.Fatalf("move %d came %v ahead of its schedule", i, ahead)
		}
	}

	// A stall of 50 intervals: a tenth of a second (10 moves) is made up
	// for, not 50.
	now = now.Add(50 * interval)
	stalled := len(moves)
	for range 30 {
		move()
	}
	madeUp := p.catchUp() / interval
	if burst := moves[stalled+int(madeUp)+2].Sub(moves[stalled]); burst < interval {
		t.Fatalf("%d moves within %v after a stall: more than %d made up for", madeUp+3, burst, madeUp)
	}
	for i := range moves {
		for j := i; j < len(moves); j++ {
			if span := moves[j].Sub(moves[i]); j-i+1 > int(span/interval)+int(madeUp)+2 {
				t.Fatalf("%d moves within %v (%d intervals)", j-i+1, span, span/interval)
			}
		}
	}
}
