package redrive

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"

	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/internal/topics"
)

// ErrTopicNotFound is returned by a Browser when the topic does not exist.
// It is the value redislist.ErrTopicNotFound holds too, so that
// redislist.Subscriber's Browse matches it without importing this package.
var ErrTopicNotFound = topics.ErrNotFound

// A Browser reads the messages of a topic without consuming them: it
// publishes nothing, acks nothing, and creates no consumer group, offset,
// stream or table.
type Browser interface {
	// Browse calls visit with each message a consumer group's next read
	// would see, in order, until visit returns false or the topic has no
	// more. It returns an error matching ErrTopicNotFound when the topic
	// does not exist.
	Browse(ctx context.Context, topic string, visit func(*message.Message) bool) error
}

// Preview is a dry run: it reads the dead-letter topic from with b and
// reports what Run, given the same options, would do with each message,
// moving and writing nothing. Entry.Moved and Report.Moved say what would
// move. WithRate and WithIdleTimeout do not apply: a preview reads what
// the topic holds and stops.
func Preview(ctx context.Context, b Browser, from string, opts ...Option) (Report, error) {
	c := newConfig(opts)
	report := Report{DryRun: true}
	err := b.Browse(ctx, from, func(msg *message.Message) bool {
		entry, out, unknownAge := c.plan(msg, from)
		if out != nil {
			entry.Moved = true
			report.Moved++
		} else {
			report.PutBack++
			if unknownAge {
				report.UnknownAge++
			}
		}
		report.Entries = append(report.Entries, entry)
		if c.progress != nil {
			c.progress(entry)
		}
		return ctx.Err() == nil && (c.max <= 0 || report.Moved < c.max)
	})
	if err == nil {
		err = ctx.Err()
	}
	if err != nil {
		return report, fmt.Errorf("redrive: preview %s: %w", from, err)
	}
	return report, nil
}

// RedisStreamBrowser reads a Redis stream written by watermill-redisstream
// with XRANGE: the entries consumer group group has pending, then those
// after its last delivered entry (every entry when the group does not
// exist), as Run would receive them through a subscriber in that group.
func RedisStreamBrowser(client redis.UniversalClient, group string) Browser {
	return redisStreamBrowser{client: client, group: group}
}

type redisStreamBrowser struct {
	client redis.UniversalClient
	group  string
}

const browsePage = 100

func (b redisStreamBrowser) Browse(ctx context.Context, topic string, visit func(*message.Message) bool) error {
	kind, err := b.client.Type(ctx, topic).Result()
	if err != nil {
		return err
	}
	switch kind {
	case "none":
		return fmt.Errorf("%w: no Redis key %q", ErrTopicNotFound, topic)
	case "stream":
	default:
		return fmt.Errorf("redrive: Redis key %q is a %s, not a stream", topic, kind)
	}
	start := "-"
	groups, err := b.client.XInfoGroups(ctx, topic).Result()
	if err != nil {
		return err
	}
	for _, g := range groups {
		if g.Name != b.group {
			continue
		}
		// The group's pending entries come first, then the new ones.
		pendingFrom := "-"
		for {
			pending, err := b.client.XPendingExt(ctx, &redis.XPendingExtArgs{
				Stream: topic, Group: b.group, Start: pendingFrom, End: "+", Count: browsePage,
			}).Result()
			if err != nil {
				return err
			}
			for _, p := range pending {
				entries, err := b.client.XRange(ctx, topic, p.ID, p.ID).Result()
				if err != nil {
					return err
				}
				for _, x := range entries { // none when the entry was deleted
					if !b.visit(x, visit) {
						return nil
					}
				}
			}
			if len(pending) < browsePage {
				break
			}
			pendingFrom = "(" + pending[len(pending)-1].ID
		}
		start = "(" + g.LastDeliveredID
	}
	for {
		entries, err := b.client.XRangeN(ctx, topic, start, "+", browsePage).Result()
		if err != nil {
			return err
		}
		for _, x := range entries {
			if !b.visit(x, visit) {
				return nil
			}
		}
		if len(entries) < browsePage {
			return nil
		}
		start = "(" + entries[len(entries)-1].ID
	}
}

func (redisStreamBrowser) visit(x redis.XMessage, visit func(*message.Message) bool) bool {
	msg, err := redisstream.DefaultMarshallerUnmarshaller{}.Unmarshal(x.Values)
	if err != nil {
		// Not written by watermill-redisstream: show it as an undecodable
		// body rather than stop.
		msg = message.NewMessage("", nil)
	}
	return visit(msg)
}

// PostgresBrowser reads a watermill-sql topic on PostgreSQL kept in the
// default schema (DefaultPostgreSQLSchema and
// DefaultPostgreSQLOffsetsAdapter: tables watermill_<topic> and
// watermill_offsets_<topic>) with plain SELECTs: the rows after consumer
// group group's acked offset, every row when the group has none.
func PostgresBrowser(db *sql.DB, group string) Browser {
	return postgresBrowser{db: db, group: group}
}

type postgresBrowser struct {
	db    *sql.DB
	group string
}

// sqlTopic is what the browser accepts as a topic name: it becomes part
// of a quoted table name.
var sqlTopic = regexp.MustCompile(`^[A-Za-z0-9_.\-]{1,200}$`)

func (b postgresBrowser) Browse(ctx context.Context, topic string, visit func(*message.Message) bool) error {
	if !sqlTopic.MatchString(topic) {
		return fmt.Errorf("redrive: %q is not a watermill-sql topic name", topic)
	}
	messages, offsets := `"watermill_`+topic+`"`, `"watermill_offsets_`+topic+`"`
	var found sql.NullString
	if err := b.db.QueryRowContext(ctx, `SELECT to_regclass($1)::text`, messages).Scan(&found); err != nil {
		return err
	}
	if !found.Valid {
		return fmt.Errorf("%w: no table %s", ErrTopicNotFound, messages)
	}
	query := `SELECT uuid, payload, metadata FROM ` + messages + ` ORDER BY transaction_id, "offset"`
	var args []any
	if err := b.db.QueryRowContext(ctx, `SELECT to_regclass($1)::text`, offsets).Scan(&found); err != nil {
		return err
	}
	if found.Valid {
		var acked sql.NullInt64
		var txID string
		err := b.db.QueryRowContext(ctx, `SELECT offset_acked, last_processed_transaction_id::text FROM `+offsets+
			` WHERE consumer_group = $1`, b.group).Scan(&acked, &txID)
		switch {
		case errors.Is(err, sql.ErrNoRows):
		case err != nil:
			return err
		default:
			query = `SELECT uuid, payload, metadata FROM ` + messages +
				` WHERE (transaction_id = $1::xid8 AND "offset" > $2) OR transaction_id > $1::xid8` +
				` ORDER BY transaction_id, "offset"`
			args = []any{txID, acked.Int64}
		}
	}
	rows, err := b.db.QueryContext(ctx, query, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		var uuid string
		var payload, metadata []byte
		if err := rows.Scan(&uuid, &payload, &metadata); err != nil {
			return err
		}
		msg := message.NewMessage(uuid, payload)
		if len(metadata) > 0 {
			if err := json.Unmarshal(metadata, &msg.Metadata); err != nil {
				return fmt.Errorf("redrive: metadata of %s: %w", uuid, err)
			}
		}
		if !visit(msg) {
			return nil
		}
	}
	return rows.Err()
}
