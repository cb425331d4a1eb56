package redrive

import "time"

// pacer spaces a run's moves to a rate on a schedule counted from the
// first move: move n is due interval×n after it, whatever the moves
// themselves take (the publish, the ack, the read of the next message) and
// however late a timer wakes, so the run keeps the rate instead of adding
// that time to every interval. A run that fell behind (a pause of the
// process, a slow broker, no message for a while) makes up for at most
// catchUp of it, the larger of an interval and a tenth of a second: the
// moves it makes up for go back to back, so over any stretch of the run
// the rate is exceeded by that many messages at most.
type pacer struct {
	interval time.Duration
	next     time.Time // when the next move is due; zero before the first
}

// catchUp is how far behind its schedule a run may be and make up for it.
func (p *pacer) catchUp() time.Duration { return max(p.interval, 100*time.Millisecond) }

// delay books the next move and returns how long to wait for it from now
// (0: at once).
func (p *pacer) delay(now time.Time) time.Duration {
	switch floor := now.Add(-p.catchUp()); {
	case p.next.IsZero():
		p.next = now
	case p.next.Before(floor): // too far behind: make up for catchUp of it, no more
		p.next = floor
	}
	wait := p.next.Sub(now)
	p.next = p.next.Add(p.interval)
	return max(wait, 0)
}
