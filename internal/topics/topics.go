// Package topic holds what the kit's readers of a topic share without
// depending on one another: package redrive's browsers and the pub/subs that
// can be browsed (pubsub/redislist), which must not import redrive, a tool
// built above them.
package topics

import "errors"

// ErrNotFound is returned by a reader of a topic (a browser) when the topic
// does not exist. It is exported as redrive.ErrTopicNotFound and
// redislist.ErrTopicNotFound, one value under both names.
var ErrNotFound = errors.New("topic does not exist")
