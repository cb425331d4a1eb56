package matrix

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
)

// ledger counts, in Redis, every run of the handler and every effect, per
// meta.id, and what the guard decided: the test and its consumer processes
// write to the same one, so a count survives a SIGKILL.
type ledger struct {
	rdb *redis.Client
	ns  string
}

func (l ledger) key(what string) string { return l.ns + ":ledger:" + what }

// run counts a run of id and returns the runs counted so far.
func (l ledger) run(ctx context.Context, id string) (int, error) {
	n, err := l.rdb.HIncrBy(ctx, l.key("runs"), id, 1).Result()
	return int(n), err
}

// effect counts the effect of id, and notes when the first happened.
func (l ledger) effect(ctx context.Context, id string) error {
	pipe := l.rdb.TxPipeline()
	pipe.HIncrBy(ctx, l.key("effects"), id, 1)
	pipe.HSetNX(ctx, l.key("effect-at"), id, time.Now().UnixMilli())
	_, err := pipe.Exec(ctx)
	return err
}

// note counts something that happened to id (a cancelled context).
func (l ledger) note(ctx context.Context, id, what string) error {
	return l.rdb.HIncrBy(ctx, l.key("notes"), id+" "+what, 1).Err()
}

// outcome counts a decision of the guard.
func (l ledger) outcome(ctx context.Context, o idempotency.Outcome) {
	_ = l.rdb.HIncrBy(ctx, l.key("outcomes"), string(o), 1).Err()
}

// counts reads a hash of counts.
func (l ledger) counts(ctx context.Context, what string) (map[string]int, error) {
	raw, err := l.rdb.HGetAll(ctx, l.key(what)).Result()
	if err != nil {
		return nil, err
	}
	out := make(map[string]int, len(raw))
	for k, v := range raw {
		n, err := strconv.Atoi(v)
		if err != nil {
			return nil, fmt.Errorf("%s[%s] = %q: %w", what, k, v, err)
		}
		out[k] = n
	}
	return out, nil
}

// effectAt returns when id's first effect happened (zero: none yet).
func (l ledger) effectAt(ctx context.Context, id string) (time.Time, error) {
	ms, err := l.rdb.HGet(ctx, l.key("effect-at"), id).Int64()
	if errors.Is(err, redis.Nil) {
		return time.Time{}, nil
	}
	return time.UnixMilli(ms), err
}

// observer counts the guard's decisions in the ledger.
func (l ledger) observer() idempotency.Observer {
	return idempotency.ObserverFunc(func(_ context.Context, e idempotency.Event) {
		l.outcome(context.Background(), e.Outcome)
	})
}

// The kinds of message the handler knows, from the envelope's data.kind.
const (
	kindOK       = "ok"       // charged at once
	kindPoison   = "poison"   // fails on every run
	kindFlaky    = "flaky"    // fails on its first two runs, then is charged
	kindSlow     = "slow"     // runs longer than the broker's deadline, then is charged
	kindSlowFail = "slowfail" // runs a while, then fails, every time
	kindHold     = "hold"     // held for ever by a holder process (killed), charged elsewhere
	kindRedrive  = "redrive"  // fails until the gateway is fixed (the ledger's "fixed" flag)
)

const job = "urn:babel:payments:charge"

// payment is the data of the envelopes the matrix publishes.
type payment struct {
	I    int    `json:"i"`
	Kind string `json:"kind"`
}

// behaviour is what one consumer's handler does with the slow kinds.
type behaviour struct {
	slow, slowFail time.Duration
	// holder: a hold message is held for ever ("holding <id>" written to
	// out first); elsewhere it is charged.
	holder bool
	out    io.Writer
	outMu  *sync.Mutex
}

// errDeclined is the poison message's failure.
var errDeclined = errors.New("card declined")

// handler is the payment handler every consumer of the matrix runs: each
// run and each effect counted in the ledger.
func handler(l ledger, b behaviour) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		ctx := msg.Context()
		e, err := envelope.Parse(msg.Payload)
		if err != nil {
			return err
		}
		var p payment
		if err := json.Unmarshal(e.Data, &p); err != nil {
			return err
		}
		id := e.Meta.ID
		// The ledger's writes must land even when the delivery's context
		// ends: it counts what happened.
		bg := context.WithoutCancel(ctx)
		runs, err := l.run(bg, id)
		if err != nil {
			return err
		}
		switch p.Kind {
		case kindPoison:
			return fmt.Errorf("payment %d: %w", p.I, errDeclined)
		case kindFlaky:
			if runs <= 2 {
				return fmt.Errorf("payment %d: gateway timeout (run %d)", p.I, runs)
			}
		case kindSlow:
			if err := sleep(ctx, b.slow); err != nil {
				_ = l.note(bg, id, "cancelled")
				_ = l.note(bg, id, "cause: "+cause(ctx))
				return fmt.Errorf("payment %d: the charge was cut short: %w", p.I, err)
			}
		case kindSlowFail:
			if err := sleep(ctx, b.slowFail); err != nil {
				_ = l.note(bg, id, "cancelled")
				_ = l.note(bg, id, "cause: "+cause(ctx))
				return fmt.Errorf("payment %d: cut short: %w", p.I, err)
			}
			return fmt.Errorf("payment %d: gateway error after %v", p.I, b.slowFail)
		case kindHold:
			if b.holder {
				b.outMu.Lock()
				fmt.Fprintf(b.out, "holding %s\n", id)
				b.outMu.Unlock()
				select {} // until the SIGKILL
			}
		case kindRedrive:
			if fixed, err := l.rdb.Exists(bg, l.key("fixed")).Result(); err != nil {
				return err
			} else if fixed == 0 {
				return fmt.Errorf("payment %d: gateway down", p.I)
			}
		}
		return l.effect(bg, id)
	}
}

// cause says why ctx ended, in a few words.
func cause(ctx context.Context) string {
	c := context.Cause(ctx)
	if c == nil {
		return "none"
	}
	text := c.Error()
	if len(text) > 60 {
		text = text[:60]
	}
	return text
}

// sleep waits for d, or until ctx ends (its error then).
func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return ctx.Err()
	case <-ctx.Done():
		return ctx.Err()
	}
}

// newPayment returns an envelope of kind for topic, as a message.
func newPayment(topic string, i int, kind string) (id string, msg *message.Message, err error) {
	e, err := envelope.New(job, payment{I: i, Kind: kind}, envelope.WithQueue(topic))
	if err != nil {
		return "", nil, err
	}
	body, err := e.Marshal()
	if err != nil {
		return "", nil, err
	}
	return e.Meta.ID, message.NewMessage(watermill.NewUUID(), body), nil
}
