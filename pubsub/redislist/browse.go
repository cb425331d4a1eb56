package redislist

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/internal/topics"
)

// browsePage is how many values one LRANGE of Browse reads.
const browsePage = 100

// ErrTopicNotFound is returned by Browse for a topic with no list. It is the
// value of redrive.ErrTopicNotFound, so either name matches it.
var ErrTopicNotFound = topics.ErrNotFound

// Browse calls visit with each message waiting on topic's ready list, in
// order, until visit returns false or the list ends, without taking,
// reserving or changing anything: a Subscriber is the redrive.Browser of its
// layout, for package redrive's dry run (redrive.Preview). A topic with no
// list is an error matching ErrTopicNotFound.
func (s *Subscriber) Browse(ctx context.Context, topic string, visit func(*message.Message) bool) error {
	if topic == "" {
		return ErrEmptyTopic
	}
	k := s.cfg.keys(s.client, topic)
	kind, err := s.client.Type(ctx, k.ready).Result()
	if err != nil {
		return fmt.Errorf("redislist: browse %s: %w", k.ready, err)
	}
	switch kind {
	case "list":
	case "none":
		return fmt.Errorf("%w: no Redis list %q", ErrTopicNotFound, k.ready)
	default:
		return fmt.Errorf("redislist: browse: Redis key %q is a %s, not a list", k.ready, kind)
	}
	for start := int64(0); ; start += browsePage {
		values, err := s.client.LRange(ctx, k.ready, start, start+browsePage-1).Result()
		if err != nil {
			return fmt.Errorf("redislist: browse %s: %w", k.ready, err)
		}
		for _, v := range values {
			if !visit(s.cfg.browsed([]byte(v))) {
				return nil
			}
		}
		if len(values) < browsePage {
			return nil
		}
	}
}

// browsed is the message a stored value is delivered as, in this layout.
func (c config) browsed(value []byte) *message.Message {
	if c.layout == LayoutLaravel {
		return laravelMessage(laravelJob(value))
	}
	return toMessage(value)
}

// Len returns the number of messages waiting on topic's ready list (its
// LLEN), without changing anything: 0 for a topic with no list.
func (s *Subscriber) Len(ctx context.Context, topic string) (int64, error) {
	if topic == "" {
		return 0, ErrEmptyTopic
	}
	k := s.cfg.keys(s.client, topic)
	n, err := s.client.LLen(ctx, k.ready).Result()
	if err != nil {
		return 0, fmt.Errorf("redislist: len %s: %w", k.ready, err)
	}
	return n, nil
}
