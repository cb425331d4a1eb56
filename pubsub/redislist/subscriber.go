package redislist

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"
)

// Subscriber consumes a Redis list queue in the chosen layout. Each
// Subscribe call is one consumer that hands over one message at a time;
// call Subscribe several times (or run several handlers) for more. It is
// safe for concurrent use.
type Subscriber struct {
	client redis.UniversalClient
	cfg    config

	closeCtx context.Context
	closeNow context.CancelFunc

	mu     sync.Mutex
	closed bool
	wg     sync.WaitGroup
}

var _ message.Subscriber = (*Subscriber)(nil)

// NewSubscriber returns a Subscriber over client. The client stays the
// caller's: Close does not close it.
func NewSubscriber(client redis.UniversalClient, opts ...Option) (*Subscriber, error) {
	if client == nil {
		return nil, fmt.Errorf("redislist: nil redis client")
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Subscriber{client: client, cfg: newConfig(opts), closeCtx: ctx, closeNow: cancel}, nil
}

// Subscribe starts one consumer of the queue topic. The channel is closed
// when ctx is done or the Subscriber is closed, once the message in flight
// was acked or nacked (or WithCloseTimeout passed). A message the consumer
// reserved but no one received goes back to the head of the queue.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if topic == "" {
		return nil, ErrEmptyTopic
	}
	if _, cluster := s.client.(*redis.ClusterClient); cluster && s.cfg.layout == LayoutReliableList && !hasHashTag(s.cfg.prefix+topic) {
		return nil, fmt.Errorf("subscribe %q: %w", topic, ErrNoHashTag)
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, ErrClosed
	}
	s.wg.Add(1)
	s.mu.Unlock()

	subCtx, cancel := context.WithCancel(ctx)
	stopAfter := context.AfterFunc(s.closeCtx, cancel)
	c := &consumer{
		s:      s,
		keys:   s.cfg.keys(s.client, topic),
		ctx:    subCtx,
		msgCtx: context.WithoutCancel(ctx),
		out:    make(chan *message.Message),
		log:    s.cfg.logger.With(watermill.LogFields{"topic": topic, "layout": s.cfg.layout.String()}),
	}
	go func() {
		defer s.wg.Done()
		defer close(c.out)
		defer stopAfter()
		defer cancel()
		var reclaim sync.WaitGroup
		if s.cfg.layout == LayoutReliableList {
			reclaim.Add(1)
			go func() {
				defer reclaim.Done()
				c.reclaimLoop()
			}()
		}
		c.run()
		cancel()
		reclaim.Wait()
	}()
	return c.out, nil
}

// Close stops every consumer and returns once each has handed back what
// no one received, seen its message in flight acked or nacked (or
// WithCloseTimeout passed) and stopped. It does not close the Redis client.
func (s *Subscriber) Close() error {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	s.closeNow()
	s.wg.Wait()
	return nil
}

// consumer is one Subscribe call.
type consumer struct {
	s      *Subscriber
	keys   keys
	ctx    context.Context // done when the subscription stops
	msgCtx context.Context // values of the Subscribe context, never done
	out    chan *message.Message
	log    watermill.LoggerAdapter
}

// reservation is one message a consumer holds.
type reservation struct {
	value  []byte // the stored value (reliable list) or the job (Laravel)
	member string // the lease member (reliable list) or reserved member (Laravel)
	token  string // the reservation's token (Laravel)
	msg    *message.Message
	cancel context.CancelFunc // cancels msg's context
}

// opCtx returns a context for one Redis call that must finish even when
// the subscription is stopping.
func (c *consumer) opCtx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), c.s.cfg.opTimeout)
}

// run hands over one message at a time. While a handler works on one, the
// next is already reserved (prefetched, in the same script that sends the
// previous ack or nack), so the next handler starts as soon as the ack
// comes; the prefetched message is leased like the one in flight and goes
// back to the head of the queue if the consumer stops first.
func (c *consumer) run() {
	var (
		pending  settlement   // the last ack or nack, not sent yet
		current  *reservation // reserved, to hand over next
		fetching chan fetched // the prefetch in flight, or nil
	)
	defer func() {
		ctx, cancel := c.opCtx()
		defer cancel()
		if fetching != nil {
			if f := <-fetching; f.r != nil {
				c.giveBackLogged(ctx, f.r)
			}
		}
		if current != nil {
			c.giveBackLogged(ctx, current)
		}
		if pending.r != nil {
			c.settle(ctx, pending)
		}
	}()
	backoff := 50 * time.Millisecond
	for c.ctx.Err() == nil {
		if current == nil {
			r, err := c.reserve(pending)
			pending = settlement{}
			if err != nil {
				c.log.Error("reserve failed", err, nil)
				select {
				case <-c.ctx.Done():
				case <-time.After(backoff):
				}
				backoff = min(2*backoff, 5*time.Second)
				continue
			}
			backoff = 50 * time.Millisecond
			if r == nil {
				continue
			}
			current = r
		}
		if !c.handOver(current, &pending) {
			return
		}
		r := current
		current = nil
		fetching = c.prefetch(pending)
		pending = settlement{}
		s, next, ok := c.await(r, &fetching)
		current = next
		if !ok {
			return
		}
		if fetching != nil {
			f := <-fetching
			fetching = nil
			current = f.r
			if f.err != nil {
				c.log.Error("reserve failed", f.err, nil)
			}
		}
		pending = s
	}
}

// fetched is the result of a prefetch.
type fetched struct {
	r   *reservation
	err error
}

// prefetch sends p and reserves the next message in the background.
func (c *consumer) prefetch(p settlement) chan fetched {
	ch := make(chan fetched, 1)
	go func() {
		r, err := c.reserve(p)
		ch <- fetched{r, err}
	}()
	return ch
}

// settlement is the outcome of one delivery: kind is "ack" or "nack".
type settlement struct {
	kind string
	r    *reservation
}

// settle sends an ack or a nack on its own.
func (c *consumer) settle(ctx context.Context, s settlement) {
	var err error
	if s.kind == "ack" {
		err = c.ack(ctx, s.r)
	} else {
		err = c.nack(ctx, s.r)
	}
	if err != nil {
		c.log.Error(s.kind+" failed; the message will be delivered again", err, watermill.LogFields{"uuid": s.r.msg.UUID})
	}
}

func (c *consumer) giveBackLogged(ctx context.Context, r *reservation) {
	if r.cancel != nil {
		r.cancel()
	}
	if err := c.giveBack(ctx, r); err != nil {
		c.log.Error("give back failed; the message comes back when its reservation lapses", err, watermill.LogFields{"uuid": r.msg.UUID})
	}
}

// ackGrace is how long a pending ack waits for the receiver to take the
// next message before it is sent on its own.
const ackGrace = 20 * time.Millisecond

// handOver passes r to the receiver of the channel, keeping its lease
// alive while no one takes it. When no one takes it within ackGrace,
// pending is sent first, so an ack never waits long for the next receiver. It returns
// false when the consumer stops first; r is then still reserved.
func (c *consumer) handOver(r *reservation, pending *settlement) bool {
	mctx, cancel := context.WithCancel(c.msgCtx)
	r.msg.SetContext(mctx)
	r.cancel = cancel
	if pending.r != nil {
		// Give the receiver a moment to come back for the next message:
		// the pending ack then goes out with the next prefetch.
		grace := time.NewTimer(ackGrace)
		select {
		case c.out <- r.msg:
			grace.Stop()
			return true
		case <-grace.C:
		case <-c.ctx.Done():
			grace.Stop()
			return false
		}
		ctx, cancel := c.opCtx()
		c.settle(ctx, *pending)
		cancel()
		*pending = settlement{}
	}
	ticker := time.NewTicker(c.s.cfg.visibility / 3)
	defer ticker.Stop()
	for {
		select {
		case c.out <- r.msg:
			return true
		case <-ticker.C:
			c.extendLogged(r)
		case <-c.ctx.Done():
			return false
		}
	}
}

func (c *consumer) extendLogged(r *reservation) {
	ctx, cancel := c.opCtx()
	defer cancel()
	if err := c.extend(ctx, r); err != nil {
		c.log.Error("extend reservation failed", err, watermill.LogFields{"uuid": r.msg.UUID})
	}
}

// await waits for r's ack or nack, which it returns for the next
// reservation to send, keeping the leases of r and of the prefetched
// message alive, and collects the prefetch if it lands meanwhile. ok is
// false when the consumer stops and r was not settled within
// WithCloseTimeout: r is then left to its lease.
func (c *consumer) await(r *reservation, fetching *chan fetched) (s settlement, next *reservation, ok bool) {
	defer r.cancel()
	ticker := time.NewTicker(c.s.cfg.visibility / 3)
	defer ticker.Stop()
	stopping := c.ctx.Done()
	var deadline <-chan time.Time
	for {
		select {
		case <-r.msg.Acked():
			return settlement{kind: "ack", r: r}, next, true
		case <-r.msg.Nacked():
			return settlement{kind: "nack", r: r}, next, true
		case f := <-*fetching:
			*fetching = nil
			next = f.r
			if f.err != nil {
				c.log.Error("reserve failed", f.err, nil)
			}
		case <-ticker.C:
			c.extendLogged(r)
			if next != nil {
				c.extendLogged(next)
			}
		case <-stopping:
			stopping = nil
			deadline = time.After(c.s.cfg.closeTimeout)
		case <-deadline:
			c.log.Info("closing without an ack; the message comes back when its reservation lapses", watermill.LogFields{"uuid": r.msg.UUID})
			return settlement{}, next, false
		}
	}
}

// reserve sends the pending settlement and takes the next message.
func (c *consumer) reserve(pending settlement) (*reservation, error) {
	if c.s.cfg.layout == LayoutLaravel {
		if pending.r != nil {
			ctx, cancel := c.opCtx()
			c.settle(ctx, pending)
			cancel()
		}
		return c.reserveLaravel()
	}
	return c.reserveList(pending)
}

func (c *consumer) ack(ctx context.Context, r *reservation) error {
	if c.s.cfg.layout == LayoutLaravel {
		return c.s.client.ZRem(ctx, c.keys.processing, r.member).Err()
	}
	n, err := ackScript.Run(ctx, c.s.client, c.listKeys(), r.value, r.member).Int()
	if err == nil && n == 0 {
		c.log.Info("acked after the reservation lapsed; the message was delivered again", watermill.LogFields{"uuid": r.msg.UUID})
	}
	return err
}

func (c *consumer) nack(ctx context.Context, r *reservation) error {
	if c.s.cfg.layout == LayoutLaravel {
		// The release carries the reservation's token, so that copies of
		// one job released together stay apart in the delayed set.
		next, ok := bumpAttempts(r.value)
		if ok {
			next = withMember(next, LaravelReservationKey, strconv.AppendQuote(nil, r.token))
		} else {
			next = []byte(r.member)
		}
		at := time.Now().Add(c.s.cfg.release).Unix()
		return laravelReleaseScript.Run(ctx, c.s.client, []string{c.keys.leases, c.keys.processing}, r.member, at, next).Err()
	}
	next, _ := bumpValue(r.value)
	return requeueScript.Run(ctx, c.s.client, c.listKeys(), r.value, r.member, next, "RPUSH").Err()
}

func (c *consumer) giveBack(ctx context.Context, r *reservation) error {
	if c.s.cfg.layout == LayoutLaravel {
		return laravelGiveBackScript.Run(ctx, c.s.client, []string{c.keys.ready, c.keys.processing, c.keys.notify}, r.member, r.value).Err()
	}
	return requeueScript.Run(ctx, c.s.client, c.listKeys(), r.value, r.member, r.value, "LPUSH").Err()
}

func (c *consumer) extend(ctx context.Context, r *reservation) error {
	if c.s.cfg.layout == LayoutLaravel {
		return c.s.client.ZAddXX(ctx, c.keys.processing, redis.Z{Score: float64(c.laravelDeadline()), Member: r.member}).Err()
	}
	return leaseScript.Run(ctx, c.s.client, []string{c.keys.leases}, c.s.cfg.visibility.Milliseconds(), r.member, "XX").Err()
}

func (c *consumer) listKeys() []string {
	return []string{c.keys.ready, c.keys.processing, c.keys.leases}
}

// reserveList sends the pending settlement and takes the head of the
// queue, with its lease, in one script; with the queue empty, it waits up
// to WithBlockTime for a value (a blocking move that moves nothing) and
// runs the script again. It returns nil, nil when nothing came.
func (c *consumer) reserveList(pending settlement) (*reservation, error) {
	token := newToken()
	ctx, cancel := c.opCtx()
	defer cancel()
	args := []any{c.s.cfg.visibility.Milliseconds(), token, "", "", "", ""}
	if pending.r != nil {
		args[2], args[3], args[4] = pending.kind, pending.r.value, pending.r.member
		if pending.kind == "nack" {
			args[5], _ = bumpValue(pending.r.value)
		}
	}
	res, err := reserveScript.Run(ctx, c.s.client, c.listKeys(), args...).Slice()
	if err != nil {
		if pending.r != nil {
			c.log.Error(pending.kind+" failed; the message will be delivered again", err, watermill.LogFields{"uuid": pending.r.msg.UUID})
		}
		return nil, fmt.Errorf("reserve from %q: %w", c.keys.ready, err)
	}
	if len(res) == 2 {
		if n, _ := res[0].(int64); n == 0 && pending.r != nil {
			c.log.Info(pending.kind+" after the reservation lapsed; the message was delivered again", watermill.LogFields{"uuid": pending.r.msg.UUID})
		}
		if v, ok := res[1].(string); ok {
			return c.listReservation(v, token), nil
		}
	}
	if c.ctx.Err() != nil {
		return nil, nil
	}
	// Wait for a value with a blocking move of the queue's head onto
	// itself: it changes nothing, so a reply lost on the way (and go-redis
	// sending the command again) can strand no value outside the queue.
	// The value is then reserved, with its lease, by the same atomic script
	// as above. The wait is bounded by WithBlockTime; it is never abandoned
	// half way.
	bctx, bcancel := context.WithTimeout(context.Background(), c.s.cfg.block+c.s.cfg.opTimeout)
	defer bcancel()
	_, err = c.blocking(bctx, "BLMOVE", c.keys.ready, c.keys.ready, "LEFT", "LEFT")
	if errors.Is(err, redis.Nil) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("wait on %q: %w", c.keys.ready, err)
	}
	args = []any{c.s.cfg.visibility.Milliseconds(), token, "", "", "", ""}
	res, err = reserveScript.Run(bctx, c.s.client, c.listKeys(), args...).Slice()
	if err != nil {
		return nil, fmt.Errorf("reserve from %q: %w", c.keys.ready, err)
	}
	if len(res) == 2 {
		if v, ok := res[1].(string); ok {
			return c.listReservation(v, token), nil
		}
	}
	return nil, nil // another consumer took it first
}

// blocking runs a blocking list command with the WithBlockTime timeout.
// go-redis's helpers take whole seconds only; a shorter wait is sent as
// Redis 6's fractional seconds instead (it then relies on the client's
// read timeout being longer, as it is by default).
func (c *consumer) blocking(ctx context.Context, name string, args ...string) (string, error) {
	block := c.s.cfg.block
	if block >= time.Second && block%time.Second == 0 {
		if name == "BLPOP" {
			r, err := c.s.client.BLPop(ctx, block, args...).Result()
			if err != nil {
				return "", err
			}
			return r[1], nil
		}
		return c.s.client.BLMove(ctx, args[0], args[1], args[2], args[3], block).Result()
	}
	cmd := make([]any, 0, len(args)+2)
	cmd = append(cmd, name)
	for _, a := range args {
		cmd = append(cmd, a)
	}
	cmd = append(cmd, strconv.FormatFloat(block.Seconds(), 'f', 3, 64))
	res, err := c.s.client.Do(ctx, cmd...).Result()
	if err != nil {
		return "", err
	}
	switch r := res.(type) {
	case string:
		return r, nil
	case []any:
		if len(r) == 2 {
			if s, ok := r[1].(string); ok {
				return s, nil
			}
		}
	}
	return "", fmt.Errorf("%s: unexpected reply %T", name, res)
}

// newToken returns a random token of leaseTokenLen hex digits.
func newToken() string {
	return strconv.FormatUint(rand.Uint64()|1<<63, 16)[:leaseTokenLen]
}

func (c *consumer) listReservation(v, token string) *reservation {
	return &reservation{value: []byte(v), member: token + v, msg: toMessage([]byte(v))}
}

// reclaimLoop moves back to the queue, every half visibility timeout, the
// values whose lease lapsed.
func (c *consumer) reclaimLoop() {
	every := min(max(c.s.cfg.visibility/2, 10*time.Millisecond), time.Minute)
	for {
		ctx, cancel := c.opCtx()
		for {
			n, err := reclaimScript.Run(ctx, c.s.client, c.listKeys(), 100).Int()
			if err != nil {
				c.log.Error("reclaim lapsed reservations failed", err, nil)
			}
			if n > 0 {
				c.log.Info("reclaimed lapsed reservations", watermill.LogFields{"count": n})
			}
			if err != nil || n < 100 {
				break
			}
		}
		cancel()
		select {
		case <-c.ctx.Done():
			return
		case <-time.After(every):
		}
	}
}

// laravelDeadline is now plus the visibility timeout in whole seconds (at
// least one), Laravel's retry_after.
func (c *consumer) laravelDeadline() int64 {
	secs := int64(math.Ceil(c.s.cfg.visibility.Seconds()))
	return time.Now().Unix() + max(secs, 1)
}

// reserveLaravel migrates due delayed jobs and lapsed reservations, pops,
// and with nothing ready waits on the notify list, as Laravel's worker does.
func (c *consumer) reserveLaravel() (*reservation, error) {
	ctx, cancel := c.opCtx()
	defer cancel()
	now := time.Now().Unix()
	k := c.keys
	for _, from := range []string{k.leases, k.processing} {
		if err := laravelMigrateScript.Run(ctx, c.s.client, []string{from, k.ready, k.notify}, now).Err(); err != nil {
			return nil, fmt.Errorf("migrate %q: %w", from, err)
		}
	}
	for attempt := 0; ; attempt++ {
		token := newToken()
		res, err := laravelPopScript.Run(ctx, c.s.client, []string{k.ready, k.processing, k.notify}, c.laravelDeadline(), token, LaravelReservationKey, FrameKey, FrameBodyBase64Key).Slice()
		if err != nil {
			return nil, fmt.Errorf("pop %q: %w", k.ready, err)
		}
		if len(res) == 2 {
			job, ok1 := res[0].(string)
			member, ok2 := res[1].(string)
			if ok1 && ok2 {
				value := laravelJob([]byte(job))
				return &reservation{value: value, member: member, token: token, msg: laravelMessage(value)}, nil
			}
		}
		if attempt > 0 || c.ctx.Err() != nil {
			return nil, nil
		}
		bctx, bcancel := context.WithTimeout(context.Background(), c.s.cfg.block+c.s.cfg.opTimeout)
		_, err = c.blocking(bctx, "BLPOP", k.notify)
		bcancel()
		if errors.Is(err, redis.Nil) {
			return nil, nil
		}
		if err != nil {
			return nil, fmt.Errorf("wait on %q: %w", k.notify, err)
		}
	}
}
