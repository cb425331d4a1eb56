package redislist

import (
	"context"
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"
)

// Publisher puts messages on a Redis list queue in the chosen layout. It is
// safe for concurrent use.
type Publisher struct {
	client redis.UniversalClient
	cfg    config

	mu     sync.RWMutex
	closed bool
}

var _ message.Publisher = (*Publisher)(nil)

// NewPublisher returns a Publisher over client. The client stays the
// caller's: Close does not close it.
func NewPublisher(client redis.UniversalClient, opts ...Option) (*Publisher, error) {
	if client == nil {
		return nil, fmt.Errorf("redislist: nil redis client")
	}
	return &Publisher{client: client, cfg: newConfig(opts)}, nil
}

// Publish puts msgs on the queue topic in one command (one RPUSH, or one
// push script in the Laravel layout), so either all of them are queued or
// none. The call is bounded by the first message's context and by
// WithOperationTimeout.
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.closed {
		return ErrClosed
	}
	if topic == "" {
		return ErrEmptyTopic
	}
	if len(msgs) == 0 {
		return nil
	}
	values := make([]any, len(msgs))
	for i, msg := range msgs {
		if p.cfg.layout == LayoutLaravel {
			v, err := laravelValue(msg)
			if err != nil {
				return fmt.Errorf("publish %s to %q: encode wrapper: %w", msg.UUID, topic, err)
			}
			values[i] = v
			continue
		}
		v, err := listValue(msg)
		if err != nil {
			return fmt.Errorf("publish %s to %q: encode frame: %w", msg.UUID, topic, err)
		}
		values[i] = v
	}
	ctx, cancel := context.WithTimeout(msgs[0].Context(), p.cfg.opTimeout)
	defer cancel()
	k := p.cfg.keys(p.client, topic)
	var err error
	if p.cfg.layout == LayoutLaravel {
		err = laravelPushScript.Run(ctx, p.client, []string{k.ready, k.notify}, values...).Err()
	} else {
		err = p.client.RPush(ctx, k.ready, values...).Err()
	}
	if err != nil {
		return fmt.Errorf("publish %d message(s) to %q: %w", len(msgs), topic, err)
	}
	return nil
}

// Close makes later Publish calls fail with ErrClosed. It does not close
// the Redis client.
func (p *Publisher) Close() error {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	return nil
}
