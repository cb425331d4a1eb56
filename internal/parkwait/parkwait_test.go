package parkwait

import (
	"context"
	"testing"
	"time"
)

func TestPausesGrowAndStopAtTheDeadline(t *testing.T) {
	t.Parallel()
	w := Until(time.Now().Add(time.Hour))
	var got []time.Duration
	for range 6 {
		got = append(got, w.pause)
		w.pause = min(2*w.pause, MaxPause) // what Pause does, without the wait
	}
	want := []time.Duration{20 * time.Millisecond, 40 * time.Millisecond, 80 * time.Millisecond, 160 * time.Millisecond, MaxPause, MaxPause}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("pauses %v, want %v", got, want)
		}
	}
	done := Until(time.Now().Add(-time.Millisecond))
	if done.Pause(context.Background()) {
		t.Fatal("Pause after the deadline asked for another look")
	}
	start := time.Now()
	short := Until(time.Now().Add(5 * time.Millisecond))
	if !short.Pause(context.Background()) {
		t.Fatal("Pause before the deadline gave up")
	}
	if took := time.Since(start); took < 5*time.Millisecond {
		t.Fatalf("Pause returned after %v, before the deadline it was cut to", took)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if Until(time.Now().Add(time.Hour)).Pause(ctx) {
		t.Fatal("Pause on a done context asked for another look")
	}
}
