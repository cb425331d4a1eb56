// Package redislist is a Watermill Publisher and Subscriber for the Redis
// list layouts that BabelQueue services in other languages read and write,
// so a Go router (with the kit's idempotency and dead-letter middleware)
// consumes what a Python, Go or PHP service put on a Redis queue, and
// produces what they consume.
//
// It speaks two layouts, chosen with WithLayout.
//
//	client := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
//	sub, _ := redislist.NewSubscriber(client, redislist.WithVisibilityTimeout(2*time.Minute))
//	pub, _ := redislist.NewPublisher(client)
//	dlq, _ := deadletter.Middleware(pub) // dead letters on <queue>.dlq, a list the SDKs read
//	router.AddMiddleware(dlq, idempotency.Middleware(store, idempotency.WithClaim(time.Minute)))
//	router.AddConsumerHandler("charge", "payments", sub, charge)
//
// For PHP workers on Laravel's queue, pass WithLayout(LayoutLaravel) to both.
//
// The Python and Go SDKs' Redis transports and Node's @babelqueue/redis
// adapter use the reliable list as they are. A dead letter the kit writes
// there is always a frame: its dead-letter metadata (bq-dead-letter-reason,
// bq-dead-letter-error, …) become the frame's headers and its "body" is the
// envelope with its "dead_letter" block, which the SDKs read from a frame.
// The Python SDK's laravel_compat mode uses the Laravel layout: pass
// WithKeyPrefix its key_prefix less "queues:" (nothing for its default,
// "queues:") and WithVisibilityTimeout its retry_after, 60 seconds by
// default (Laravel's own default is 90).
//
// # The reliable list (LayoutReliableList, the default)
//
// The layout of the BabelQueue SDK runtimes. The topic is the queue name.
//
//   - Publish: RPUSH <queue> of the payload, byte for byte. When the
//     message carries out-of-band headers the value is a frame instead:
//     {"__bq_frame":1,"headers":{"traceparent":"00-…"},"body":"<payload as a JSON string>"}.
//     Every metadata entry whose key and value are not blank becomes a
//     header, except the three projections of the body (bq-message-id,
//     bq-trace-id, bq-job), which restate what the body already says. A
//     payload without a meta.id also carries the Watermill UUID, as the
//     header HeaderUUID. With no header left the value is the bare payload.
//     A frame's "body" is a JSON string, which cannot hold bytes that are
//     not UTF-8 unchanged: such a payload (protobuf, a compressed body)
//     travels base64-encoded (standard alphabet, padded) under the member
//     "body_b64" (FrameBodyBase64Key) instead of "body". This package reads
//     it back byte for byte; an SDK runtime, which knows only "body", reads
//     such a value as a bare body that is not an envelope, as it would the
//     binary payload itself. A binary dead letter (it carries the
//     dead-letter metadata) is therefore written, and its original leaves
//     the queue, instead of failing for ever.
//   - A message read from a list and published again unchanged (the same
//     UUID, payload and metadata: a redrive run's put-back) is written as
//     the very value it was read from. When publishing it afresh would
//     write another value (a frame another runtime wrote, with its own
//     spelling, member order or headers that are not strings; a bare value
//     without meta.id, whose UUID was made up), the delivered message
//     carries that value as the metadata entry MetadataStoredValue, a
//     transport header that children and dead letters do not inherit and
//     that is never written as a header. Any change to the message writes
//     it afresh.
//   - Subscribe: the value moves atomically from <queue> to
//     <queue>:processing with its lease (LMOVE in one script; while the
//     queue is empty the consumer waits with BLMOVE <queue> <queue> LEFT
//     LEFT, which moves nothing). A value is a frame only when it is a JSON object with a
//     truthy "__bq_frame" and a string "body" (or, with no "body", a
//     "body_b64" of valid base64); the body becomes the payload and the
//     string headers become metadata. Anything else is the payload as it
//     is.
//   - The message UUID is the envelope's meta.id; for a payload without
//     one, the HeaderUUID header, or else a fresh UUID.
//   - Ack: LREM <queue>:processing 1 <the stored value>.
//   - Nack: in one Lua script, the reserved copy is removed and the stored
//     value is pushed back on <queue> with the envelope's top-level
//     "attempts" one higher, as the SDK runtimes count a retry in the body.
//     Only the digits of that count change: every other byte of the value
//     stays as it was written, a frame's headers (strings or not), member
//     order, spacing and escapes included. A payload that is not a JSON
//     object with an integer "attempts" goes back unchanged.
//
// SDK workers never take back what a dead worker left in <queue>:processing,
// and that list holds no times. This package therefore records, for each
// value its own consumers reserve, a lease in the sorted set
// <queue>:processing:leases (scored by the deadline in Redis server time,
// the member a random token followed by the value), extends it while the
// handler runs, and removes it on ack or nack. Each subscription looks for
// lapsed leases (WithVisibilityTimeout, default 5 minutes) and moves
// exactly those values back to <queue>, one LREM and one RPUSH each in one
// script, so a value an SDK worker reserved is never touched. What an SDK
// worker leaves behind when it dies stays where the SDK leaves it.
// A value taken back after its lease lapsed is pushed back unchanged:
// "attempts" counts nacks, not crashes, as with the SDK runtimes.
// A value never sits in <queue>:processing without its lease, even when a
// reply is lost or a consumer dies while it waits on an empty queue.
//
// A message reserved by a subscription that is closed before a handler
// took it goes back to the head of <queue>, unchanged.
//
// # The Laravel layout (LayoutLaravel)
//
// The layout of Laravel's RedisQueue, for PHP workers: the topic is the
// Laravel queue name and the keys are queues:<name> (the ready list),
// queues:<name>:reserved and queues:<name>:delayed (sorted sets scored by
// Unix seconds) and queues:<name>:notify (the wake-up list). Publish pushes
// onto the ready list and the notify list in one script. Before each pop,
// due delayed jobs and reservations whose deadline passed go back to the
// ready list with a notify entry each; the pop takes the head of the ready
// list, adds it to the reserved set with its "attempts" one higher and the
// deadline now + WithVisibilityTimeout (Laravel's retry_after), and takes a
// notify entry; with nothing ready it waits on the notify list. Ack removes
// the reserved member; Nack removes it and adds the payload with "attempts"
// one higher to the delayed set, due after WithReleaseDelay. These are the
// scripts of Laravel's LuaScripts, so Go and Laravel workers share one queue.
//
// One difference keeps copies apart. Laravel's jobs are unique (each push
// carries its own "uuid" and "id"), but one message pushed twice (a redrive
// put-back taken again before the original is acked, a message published
// twice) is two byte-identical jobs, and a sorted set holds a member once:
// their two reservations would be one member, the first ack would remove
// both, and the other copy would be lost when its consumer stopped or died.
// So the pop also sets, in the reserved member, the member
// "__bq_reservation" (LaravelReservationKey) to a token of the
// reservation's own, and a Nack writes that token into the job it
// releases: every copy this package reserves or releases is a member of its
// own, and never the same member as a Laravel worker's reservation. The
// token is one more member of the job's JSON object: when a lapsed
// reservation or a due release takes the job back to the ready list, a
// Laravel worker pops it as any job (it ignores members it does not know),
// and this package delivers it without the token, every other byte as it
// was. The alternatives were weighed: refusing to reserve a job whose
// member is already reserved keeps Laravel's member as it is but holds
// every copy behind the first (and a Laravel worker's pop does not check),
// and counting copies in the subscriber does not survive a crash.
//
// The handler receives the job as it was pushed. Unlike Laravel's own pop,
// which decodes the job and encodes it again with Redis's Lua JSON library
// (which keeps 14 significant digits, writes an empty array [] as {} and
// refuses a number beyond float64 such as 1e400), the pop of this package
// edits bytes: the reserved member is the job byte for byte with only the
// digits of "attempts" changed and the reservation token added, so a job
// taken back from a worker that died comes back exact, its data, member
// order, spacing and escapes as they were, with "attempts" counted. A
// Nack writes the payload the same way. The pop removes nothing before the
// reservation is written (it reads the head of the ready list, writes the
// reservation, then pops), and working out the reserved member cannot fail:
// a value it does not read as a Laravel job is reserved wrapped, as below.
// No job is lost to a pop, and none blocks the queue. Laravel jobs carry no
// headers, so the metadata of a message whose payload is a Laravel job does
// not travel in this layout, but for the mark of a redrive
// (envelope.MetadataRedrive), which a consumer that remembers ended
// messages needs to run a redriven one again: Publish writes it into the
// job as the member "__bq_redrive" (LaravelRedriveKey), which Laravel
// workers ignore, and the Subscriber delivers it as metadata, the job
// without it. The message UUID is meta.id, else the Laravel
// job's "uuid", else a fresh one. Set WithKeyPrefix to the Laravel
// connection's prefix (for example "laravel_database_") when it has one.
//
// A payload that is not a Laravel job (not a JSON object with an integer
// "attempts": a binary or non-JSON body, or the dead letter of one) cannot
// go on the ready list as it is: Laravel's pop script fails on a value it
// cannot decode, and the value is lost to it. Publish writes it wrapped in
// a Laravel job instead:
//
//	{"uuid":"<message UUID>","displayName":"BabelQueue wrapped body","attempts":0,
//	 "__bq_frame":1,"headers":{"bq-dead-letter-reason":"failed",…},"body":"<payload>"}
//
// It is the reliable list's frame (the payload as the JSON string "body"
// when it is UTF-8, else base64-encoded under "body_b64",
// FrameBodyBase64Key; the message's metadata as "headers") with Laravel's
// "uuid", "displayName" (LaravelWrapperName) and "attempts" first. A
// Laravel worker pops it as any job (its handler then fails, the job naming
// no class, and Laravel records it as failed); this package delivers the
// payload byte for byte, with the headers as metadata and "uuid" as the
// UUID unless the payload has a meta.id. A handler that fails for good on
// such a body therefore sends it to the dead-letter queue, with the
// dead-letter metadata a redrive run reads (reason, original topic),
// instead of its original being nacked for ever. A payload that is a
// Laravel job but would read as a wrapper, or carries LaravelReservationKey,
// is wrapped too, so that every payload comes back as it was published.
// A value another producer pushed that is not a Laravel job is delivered as
// it is, and Close gives it back as it was; the pop reserves it wrapped the
// same way (base64-encoded, with no "uuid" or headers), so that a
// reservation that lapses, or a Nack, brings back a job Laravel's pop takes;
// so is a job nested deeper than the 1,000 levels Lua's JSON library reads,
// which Laravel's pop cannot take either.
//
// # Redis Cluster
//
// A move between two lists and a script over several keys need every key on
// one hash slot. In the reliable list layout name the queue with a hash tag,
// on both sides: "{orders}" keeps {orders}, {orders}:processing and
// {orders}:processing:leases together. Subscribe on a *redis.ClusterClient
// returns ErrNoHashTag for a queue name without one. In the Laravel layout
// the keys get Laravel's own tag, queues:{<name>}, when the client is a
// cluster client and the name has no tag, as Laravel does.
//
// # Delivery
//
// Delivery is at least once: a worker that dies, a lease that lapses while
// a handler is stuck, or an ack that does not reach Redis delivers a
// message again. Put the idempotency middleware in front of the handler.
// One subscription hands over one message at a time and waits for its ack
// or nack, so a single subscription sees the queue in order until a nack
// puts a message at the tail. While a handler runs, the subscription
// already holds the next message, reserved and leased like the one in
// flight (the reservation goes out in the same script as the previous
// ack), so the next handler starts as soon as the ack comes. Close stops every subscription, waits for the
// messages in flight to be acked or nacked (up to WithCloseTimeout, after
// which their message contexts are cancelled and their leases left to
// lapse), puts a reserved message no handler took back at the head of the
// queue, and returns once every goroutine has stopped.
package redislist
