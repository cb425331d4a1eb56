package postgresstore

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/babelqueue/watermill-idempotency/internal/sqlstate"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// group runs the same kind of statement for concurrent callers as one
// statement over arrays (a group commit): callers that arrive while
// maxInFlight statements of the kind are running queue up, and the first of
// them leads the next statement, carrying everyone queued meanwhile. A
// caller that finds a free slot first yields once, so that callers runnable
// at the same moment can queue behind it, then runs its statement with them
// or, when none came, alone under its own context (a claim, which must be
// undone for a caller that gives up, still runs detached): at low load
// nothing waits for company.
//
// A statement that carries several callers runs in a goroutine of its own
// (the carrier), bounded by the store's query timeout and not by any
// caller's context, so that no caller's cancellation fails the others. The
// carrier goes on with the callers queued while its statement ran, led by
// the first of them, and ends when none is: under load one goroutine, its
// stack grown once, carries statement after statement instead of starting
// a goroutine for each. What it undoes for callers that gave up runs beside
// its next statement, so that an undo that waits holds nobody back. Every
// caller waits at most until its own context is done; the statement that
// carries it then still runs; its outcome is dropped, as if the reply had
// been lost, and what it did for a caller that gave up is undone where it
// must be (undo: a claim no delivery holds would park the message's
// redelivery for its whole lease).
//
// A group with a pause (the session claims') may hold its next statement
// back a little before it takes the queue, while the store is busy: the
// callers due meanwhile share that statement instead of leading the one
// after it, which spares a round trip and a commit for each of them. The
// pause ends early when the leader's context is done, and is not taken, or
// ends, for a caller that must not wait for company (urgent: a renewal,
// which a pause could hold back past the lease it asks for).
type group struct {
	maxInFlight int
	pause       func() time.Duration                         // how long the next statement waits for more callers; nil or 0: not at all
	hurry       chan struct{}                                // with a pause (buffered, 1): an urgent caller queued; ends the pause running
	run         func(ctx context.Context, batch []*op) error // fills each op's result
	undo        func(o *op)                                  // for an op whose caller gave up; nil: keep

	mu       sync.Mutex
	queue    []*op
	inFlight int
}

// op is one caller's part of a grouped statement.
type op struct {
	key         string // RowKey
	token       string // claims
	fingerprint int64  // remembers: 0 for none
	lease       int64  // claims, in ms
	kind        int    // session claims: opClaim, opRemember or opPing
	lock        int64  // session claims: the advisory lock's key
	held        bool   // session claims' remembers: the holder held the claim on the session
	urgent      bool   // no pause for company: the statement carrying it goes at once
	value       []byte // session claims' remembers: the value kept, nil for none

	// results, written before done is closed
	claimed bool
	record  stores.Record // lookups
	err     error

	ctx   context.Context // the caller's, while queued: a carrier led by it pauses for company until it is done, and runs under its values
	done  chan struct{}   // closed when its statement ran
	state atomic.Int32    // opPending, then opSettled (results final) or opAbandoned (the caller gave up)
}

const (
	opPending int32 = iota
	opSettled
	opAbandoned
)

// giveUp settles o for a caller whose context is done: abandoned when its
// statement has not settled it yet, otherwise its real answer.
func (o *op) giveUp(ctx context.Context) error {
	if o.state.CompareAndSwap(opPending, opAbandoned) {
		return fmt.Errorf("postgresstore: %w", ctx.Err())
	}
	<-o.done // settled: done is closed at once
	return o.err
}

// unsent reports, once do returned an error, whether o was never queued
// nor run (its caller's context was done on arrival): no statement will
// settle it, so what its caller prepared for it is the caller's to undo.
func (o *op) unsent() bool { return o.state.Load() == opPending }

func newOp() *op { return &op{done: make(chan struct{})} }

// do runs o, alone or in a group, and returns once its statement ran or ctx
// is done.
func (g *group) do(ctx context.Context, timeout time.Duration, o *op) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("postgresstore: %w", err) // o is never run: unsent
	}
	g.mu.Lock()
	if g.inFlight < g.maxInFlight {
		g.inFlight++
		g.mu.Unlock()
		// Deliveries tend to arrive in bursts (the callers one statement
		// released come back together): let those already runnable queue
		// behind this one and share its statement, rather than send this
		// one alone and the burst after it. With nothing else runnable the
		// yield returns at once.
		runtime.Gosched()
		g.pauseForMore(ctx, o)
		batch := g.takeQueued(o)
		if batch == nil && g.undo != nil {
			// A kind whose work must be undone for a caller that gives up
			// (a claim) runs detached even alone: cut short by the caller's
			// deadline, its statement could still finish on the server after
			// the caller left, with nobody to undo it.
			batch = []*op{o}
		}
		if batch != nil {
			go g.carry(ctx, timeout, batch)
			return g.wait(ctx, o)
		}
		sctx, cancel := boundedContext(ctx, timeout)
		next := g.finish([]*op{o}, g.exec(sctx, []*op{o}))
		cancel()
		if next != nil {
			go func() {
				ctx, batch := g.lead(next)
				g.carry(ctx, timeout, batch)
			}()
		}
		return o.err
	}
	o.ctx = ctx
	g.queue = append(g.queue, o)
	g.mu.Unlock()
	if o.urgent {
		select { // ends the pause of the statement that will carry o, if it runs one
		case g.hurry <- struct{}{}:
		default:
		}
	}
	// A carrier takes it, whether its caller waits or not: gone before its
	// statement ran, it is still run, and settled as abandoned.
	return g.wait(ctx, o)
}

// pauseForMore holds the leader o back for the group's pause, if any, so
// that more callers queue behind it; it returns early once ctx is done or
// an urgent caller queued, and at once for an urgent leader. A hurry left
// from an urgent caller an earlier statement carried only cuts this pause
// short.
func (g *group) pauseForMore(ctx context.Context, o *op) {
	if g.pause == nil || o.urgent {
		return
	}
	d := g.pause()
	if d <= 0 {
		return
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	case <-g.hurry:
	}
}

// wait returns o's result once the statement carrying it ran, or gives up
// when ctx is done first.
func (g *group) wait(ctx context.Context, o *op) error {
	select {
	case <-o.done:
		return o.err
	case <-ctx.Done():
		return o.giveUp(ctx)
	}
}

// takeQueued returns o and everyone queued behind it as one batch, or nil
// when nobody is queued.
func (g *group) takeQueued(o *op) []*op {
	g.mu.Lock()
	defer g.mu.Unlock()
	if len(g.queue) == 0 {
		return nil
	}
	batch := append([]*op{o}, g.queue...)
	g.queue = nil
	return batch
}

// take empties the queue for the leader of a carrier's next statement: it
// carries the leader and everyone queued behind it.
func (g *group) take(leader *op) []*op {
	if batch := g.takeQueued(leader); batch != nil {
		return batch
	}
	return []*op{leader}
}

// carry runs a statement for several callers, bounded by the store's query
// timeout only, and settles them; then, while callers queued meanwhile,
// the next statement, led by the first of them (after its pause for
// company), and so on.
func (g *group) carry(ctx context.Context, timeout time.Duration, batch []*op) {
	if timeout <= 0 {
		timeout = defaultBatchTimeout
	}
	for {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), timeout)
		next := g.finish(batch, g.exec(sctx, batch))
		cancel()
		if next == nil {
			return
		}
		ctx, batch = g.lead(next)
	}
}

// lead readies the next statement of a carrier for next, the first caller
// queued when the last one finished: its pause for company, then next and
// everyone queued behind it; ctx is next's, for the statement's values.
func (g *group) lead(next *op) (ctx context.Context, batch []*op) {
	ctx = next.ctx
	g.pauseForMore(ctx, next)
	return ctx, g.take(next)
}

// exec runs the statement, again after a deadlock (its victim rolled back)
// up to deadlockRetries times, and turns a panic into an error for every
// caller it carries so that no caller waits for ever. The run after a
// deadlock can meet the other transaction again (both woke at once), hence
// more than one.
func (g *group) exec(ctx context.Context, batch []*op) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("postgresstore: panic in a grouped statement: %v", r)
		}
	}()
	err = g.run(ctx, batch)
	for retry := 0; retry < deadlockRetries && err != nil && isDeadlock(err) && ctx.Err() == nil; retry++ {
		err = g.run(ctx, batch)
	}
	return err
}

// deadlockRetries bounds the runs of a grouped statement after deadlocks.
const deadlockRetries = 3

// finish settles the callers of a statement, then passes its slot to the
// first caller queued meanwhile, returned to lead the next statement, or
// frees it (nil).
func (g *group) finish(batch []*op, err error) (next *op) {
	var abandoned []*op
	for _, o := range batch {
		if err != nil {
			o.err = err
		}
		if !o.state.CompareAndSwap(opPending, opSettled) && o.err == nil && g.undo != nil {
			abandoned = append(abandoned, o)
		}
		close(o.done)
	}
	g.mu.Lock()
	if len(g.queue) > 0 {
		next = g.queue[0] // the slot passes on: inFlight unchanged
		g.queue = g.queue[1:]
	} else {
		g.inFlight--
	}
	g.mu.Unlock()
	if len(abandoned) > 0 {
		// Undone beside the next statement, not before it: an undo that
		// waits (a claim's row held by another transaction) must not hold
		// back the callers queued meanwhile. Each undo is bounded by the
		// store's query timeout.
		go func() {
			for _, o := range abandoned {
				g.undo(o)
			}
		}()
	}
	return next
}

// boundedContext bounds ctx by timeout, unless it already has an earlier
// deadline or timeout is zero.
func boundedContext(ctx context.Context, timeout time.Duration) (context.Context, context.CancelFunc) {
	if timeout <= 0 {
		return ctx, func() {}
	}
	if d, ok := ctx.Deadline(); ok && time.Until(d) <= timeout {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, timeout)
}

// defaultBatchTimeout bounds a grouped statement when the store has no
// query timeout (WithQueryTimeout(0)).
const defaultBatchTimeout = 30 * time.Second

// isDeadlock reports a deadlock, on any driver.
func isDeadlock(err error) bool { return sqlstate.Is(err, sqlstate.DeadlockDetected) }

// keysOf returns the distinct keys of batch, sorted so that concurrent
// statements lock rows in one order.
func keysOf(batch []*op) []string {
	keys := make([]string, 0, len(batch))
	for _, o := range batch {
		keys = append(keys, o.key)
	}
	slices.Sort(keys)
	return slices.Compact(keys)
}

// runLookup reads every key of batch in one SELECT … WHERE key = ANY.
func (s *Store) runLookup(ctx context.Context, batch []*op) error {
	s.tick()
	if s.parts == nil { // a table session claims may share
		return s.runLookupLocked(ctx, batch)
	}
	if len(batch) == 1 { // alone: the plain statement, cheaper than arrays
		o := batch[0]
		r, err := scanRecord(s.db.QueryRowContext(ctx, s.lookupSQL, o.key).Scan)
		if err != nil {
			return fail(ctx, "lookup", err)
		}
		o.record = r
		return nil
	}
	rows, err := s.db.QueryContext(ctx, s.seenManySQL, uuidArray(keysOf(batch)))
	if err != nil {
		return fail(ctx, "lookup", err)
	}
	found, _, err := readLookups(rows, false)
	if err != nil {
		return fail(ctx, "lookup", err)
	}
	settleLookups(batch, found)
	return nil
}

// readLookups reads the rows of a grouped Lookup, and closes them: each
// key's record, and with locks (seenLockedSQL) the keys a claim holds.
func readLookups(rows *sql.Rows, locks bool) (found map[string]stores.Record, locked map[string]bool, err error) {
	defer rows.Close()
	found, locked = map[string]stores.Record{}, map[string]bool{}
	for rows.Next() {
		var key string
		var lockRow, claimed bool
		var fp int64
		var expires sql.NullInt64
		var value, failure []byte
		dest := []any{&key, &claimed, &fp, &expires, &value, &failure}
		if locks {
			dest = []any{&key, &lockRow, &claimed, &fp, &expires, &value, &failure}
		}
		if err := rows.Scan(dest...); err != nil {
			return nil, nil, err
		}
		if lockRow {
			locked[key] = true
			continue
		}
		r, err := record(claimed, fp, expires, value, failure)
		if err != nil {
			return nil, nil, err
		}
		found[key] = r
	}
	return found, locked, rows.Err()
}

// settleLookups gives every caller of batch its key's record (found).
func settleLookups(batch []*op, found map[string]stores.Record) {
	for _, o := range batch {
		o.record = found[o.key]
		o.record.Value = bytes.Clone(o.record.Value) // callers of one key each own theirs
	}
}

// runLookupLocked is runLookup with session claims: every key is read
// with whether a claim holds its lock (this Store's session's or another
// worker's); a key whose row says nothing is in flight (none, or a
// failing record) is then in flight.
func (s *Store) runLookupLocked(ctx context.Context, batch []*op) error {
	keys := keysOf(batch)
	rows, err := s.db.QueryContext(ctx, s.seenLockedSQL, uuidArray(keys), int64Array(s.rowLocks(keys), nil))
	if err != nil {
		return fail(ctx, "lookup", err)
	}
	found, locked, err := readLookups(rows, true)
	if err != nil {
		return fail(ctx, "lookup", err)
	}
	for key := range locked {
		if r := found[key]; r.State == stores.StateUnknown || r.State == stores.StateFailing {
			r.State, r.ExpiresAt = stores.StateInFlight, time.Time{}
			found[key] = r
		}
	}
	settleLookups(batch, found)
	return nil
}

// runRemember records every key of batch in one INSERT … SELECT FROM
// unnest … ON CONFLICT DO UPDATE, which writes no row over another
// holder's live claim (those callers get ErrClaimTaken). A key that comes
// again in the batch is recorded after it, by the plain statement, in the
// order of the calls, as if they had run one after the other.
func (s *Store) runRemember(ctx context.Context, batch []*op) error {
	s.tick()
	if len(batch) == 1 && s.session == nil { // alone: the plain statement
		o := batch[0]
		o.err = s.rememberOne(ctx, o.key, uint64(o.fingerprint), nil, o.token)
		return nil
	}
	first := make(map[string]*op, len(batch))
	var again []*op
	for _, o := range batch {
		if _, ok := first[o.key]; ok {
			again = append(again, o)
			continue
		}
		first[o.key] = o
	}
	order := make([]*op, 0, len(first))
	for _, o := range first {
		order = append(order, o)
	}
	slices.SortFunc(order, func(a, b *op) int { return strings.Compare(a.key, b.key) })
	keys := make([]string, len(order))
	fps := make([]int64, len(order))
	tokens := make([]string, len(order))
	for i, o := range order {
		keys[i], fps[i], tokens[i] = o.key, o.fingerprint, o.token
	}
	noFingerprint := func(fp int64) bool { return fp == 0 }
	rows, err := s.db.QueryContext(ctx, s.rememberManySQL, uuidArray(keys), int64Array(fps, noFingerprint), textArray(tokens), int64Array(s.rowLocks(keys), nil))
	if err != nil {
		return fail(ctx, "remember", err)
	}
	defer rows.Close()
	written := make(map[string]bool, len(order))
	for rows.Next() {
		var key string
		if err := rows.Scan(&key); err != nil {
			return fail(ctx, "remember", err)
		}
		written[key] = true
	}
	if err := rows.Err(); err != nil {
		return fail(ctx, "remember", err)
	}
	for _, o := range order {
		if !written[o.key] {
			o.err = fmt.Errorf("postgresstore: remember: %w", stores.ErrClaimTaken)
		}
	}
	for _, o := range again {
		if s.session != nil {
			if err := s.runRemember(ctx, []*op{o}); err != nil {
				o.err = err
			}
			continue
		}
		o.err = s.rememberOne(ctx, o.key, uint64(o.fingerprint), nil, o.token)
	}
	return nil
}

// runExtend extends the claims of batch in one UPDATE … FROM unnest …,
// which matches only live claims of each caller's holder; a caller whose
// key and token come back holds its claim.
func (s *Store) runExtend(ctx context.Context, batch []*op) error {
	s.tick()
	if len(batch) == 1 { // alone: the plain statement
		o := batch[0]
		held, err := s.execAs(ctx, "extend", s.extendSQL, o.key, o.lease, o.token)
		if err != nil {
			return err
		}
		o.claimed = held
		return nil
	}
	order := slices.Clone(batch)
	slices.SortStableFunc(order, func(a, b *op) int { return strings.Compare(a.key, b.key) })
	keys := make([]string, len(order))
	leases := make([]int64, len(order))
	tokens := make([]string, len(order))
	for i, o := range order {
		keys[i], leases[i], tokens[i] = o.key, o.lease, o.token
	}
	rows, err := s.db.QueryContext(ctx, s.extendManySQL, uuidArray(keys), int64Array(leases, nil), textArray(tokens))
	if err != nil {
		return fail(ctx, "extend", err)
	}
	defer rows.Close()
	held := make(map[[2]string]bool, len(batch))
	for rows.Next() {
		var key, token string
		if err := rows.Scan(&key, &token); err != nil {
			return fail(ctx, "extend", err)
		}
		held[[2]string{key, token}] = true
	}
	if err := rows.Err(); err != nil {
		return fail(ctx, "extend", err)
	}
	for _, o := range batch {
		o.claimed = held[[2]string{o.key, o.token}]
	}
	return nil
}

// runClaim tries to insert a claim row for every op of batch in one INSERT
// … SELECT FROM unnest … ON CONFLICT DO NOTHING RETURNING. An op whose row
// was inserted with its token holds the claim; the others (a key held
// already, or a second claim of one key in the batch) are settled one by one
// by the caller, as an unbatched claim that found its key held.
func (s *Store) runClaim(ctx context.Context, batch []*op) error {
	s.tick()
	if len(batch) == 1 { // alone: the plain statement
		o := batch[0]
		claimed, err := s.exec(ctx, s.claimSQL, o.key, o.lease, o.token)
		o.claimed = claimed
		return err
	}
	keys := make([]string, len(batch))
	leases := make([]int64, len(batch))
	tokens := make([]string, len(batch))
	order := make([]*op, len(batch))
	copy(order, batch)
	slices.SortStableFunc(order, func(a, b *op) int { return strings.Compare(a.key, b.key) })
	for i, o := range order {
		keys[i], leases[i], tokens[i] = o.key, o.lease, o.token
	}
	rows, err := s.db.QueryContext(ctx, s.claimManySQL, uuidArray(keys), int64Array(leases, nil), textArray(tokens))
	if err != nil {
		return fail(ctx, "claim", err)
	}
	defer rows.Close()
	holder := make(map[string]string, len(batch))
	for rows.Next() {
		var key, token string
		if err := rows.Scan(&key, &token); err != nil {
			return fail(ctx, "claim", err)
		}
		holder[key] = token
	}
	if err := rows.Err(); err != nil {
		return fail(ctx, "claim", err)
	}
	for _, o := range batch {
		token, inserted := holder[o.key]
		if inserted && token == o.token {
			o.claimed = true
			delete(holder, o.key) // one winner per key, even with equal tokens
		}
	}
	return nil
}

// undoClaim releases a claim a grouped statement took for a caller that had
// given up (its delivery failed with a store error and is redelivered with
// another holder): left in place, it would park that redelivery until the
// lease passed.
func (s *Store) undoClaim(o *op) {
	if o.claimed {
		s.releaseGivenUp(o.key, o.token)
	}
}

// releaseGivenUp releases the claim on key that token may hold, for a
// caller that gave up; a failure only leaves the claim to its lease.
func (s *Store) releaseGivenUp(key, token string) {
	ctx, cancel := s.context(context.Background())
	defer cancel()
	if _, err := s.db.ExecContext(ctx, s.releaseSQL, key, token); err != nil && s.logger != nil {
		s.logger.Warn("postgresstore: could not release a claim taken for a caller that gave up; it lapses with its lease",
			"table", s.table, "error", err)
	}
}
