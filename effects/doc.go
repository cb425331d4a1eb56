// Package effects performs the external effects a handler cannot commit with
// its message's record: a card charge, a refund, an email, a webhook to a
// partner. The idempotency middleware makes a redelivery harmless for what
// commits with the record; for these it cannot, and a charge whose reply was
// lost would be made again by the retry. This package gives each such
// effect a stable identity at its provider and a durable record with states
// of its own, so that no attempt ever sends it blindly a second time.
//
//	fx, _ := effects.New(redisstore.NewEffects(client))
//	charge := fx.Effect("charge",
//		effects.WithResolver(provider.Status), // a status lookup by provider key
//		effects.WithPolicy(effects.Resubmit)) // the provider deduplicates its idempotency keys
//
//	// inside a handler guarded by idempotency.Middleware:
//	chargeID, err := charge.Do(msg.Context(), req, func(ctx context.Context, key string) (effects.Outcome, error) {
//		return provider.Charge(ctx, key, req) // key is the Idempotency-Key
//	})
//
// # The discipline
//
//   - A stable provider key per effect (ProviderKey): derived from the
//     message's identity, its scope (the handler) and the effect's name, so
//     every attempt, every worker, every replay and every failover sends the
//     same key; none is minted for a retry.
//   - The intent is durable before the call: Do records the effect (state
//     pending, the provider key, the request's fingerprint) in the effect
//     store, on the store's own connection. In the middleware's
//     transactional mode it commits before the call, never inside the
//     handler's open transaction.
//   - A timeout is not a failure: no reply, a reset, a 5xx, a crash leave
//     the effect unknown. Only definitive evidence (the provider's answer, a
//     status lookup, a callback, an operator) moves it to succeeded, keeping
//     the provider's result for later attempts, or failed.
//   - A later attempt reconciles before it acts: finding the effect pending
//     (its attempt's lease passed) or unknown (and its request no longer on
//     its way: see Leases), it asks the Resolver first; then, per the
//     effect's Policy, it resubmits under the same key (only for a provider
//     that deduplicates keys), parks the message, or dead-letters it with
//     the reason unknown_outcome. Never a blind second call.
//   - States move only along the transitions stores.EffectTransitionAllowed
//     lists. A refund or compensation is an effect of its own (its own name,
//     so its own provider key) and can itself be unknown.
//   - Provider callbacks are applied once by the provider's event identity
//     (ApplyCallback, HTTPHandler, CallbackHandler), through the same
//     transitions: a duplicate changes nothing, an out-of-order event
//     cannot move a final effect.
//   - Operated as finite work: metrics for the effects by state and the age
//     of the oldest pending (in-progress) and unknown effect, the retry
//     budget exhausted, the decisions of every attempt (from which the
//     duplicate resolution rate and payload conflicts), spans for each
//     decision, call and lookup continuing the message's trace, and
//     Runner.Resolve (bq-idempotency effects list|resolve) for an
//     operator's manual resolution with a note, which waits for the
//     attempts still acting on the effect (see Leases).
//
// # Wiring
//
// Do needs the message's identity, which the idempotency middleware puts
// in the handler's context (idempotency.DeliveryFromContext); a delivery
// the middleware could not identify fails with ErrNoDelivery. Errors
// classify as the middleware's do: ErrUnknownOutcome (retryable under Park,
// and right after a call without an answer) and ErrBudgetExhausted or
// DeadLetter's (permanent); idempotency.ErrInFlight while another attempt
// holds the effect, idempotency.ErrStore when the store cannot be reached
// (both transient: nacked, redelivered, never dead-lettered). The
// dead-letter middleware gives errors matching ErrUnknownOutcome the reason
// unknown_outcome and ErrPayloadConflict (a changed request for the same
// message and effect) the reason conflict.
//
// The stores are memstore.NewEffects (tests, one process),
// redisstore.NewEffects and postgresstore.NewEffects; storetest.RunEffects
// proves any stores.EffectStore.
//
// # Retention
//
// A final effect (succeeded, failed) and a provider event are kept
// stores.DefaultEffectsTTL (7 days) unless the store's WithEffectsTTL says
// otherwise; pending and unknown effects are never dropped. Keep final
// effects at least as long as the replay horizon of their messages (the
// message store's TTL, or idempotency.WithReplayHorizon): a later attempt
// that finds no record begins the effect afresh, under the same provider
// key. Each store's Purge, and bq-idempotency effects purge --older-than,
// remove older final effects on demand.
//
// A store given a result lifetime (its WithResultTTL, hours or a day) keeps
// the provider's result of a succeeded effect only that long, and the rest
// of the record (state, provider key, fingerprint, attempts) for the
// effects TTL: the result's bytes go early, the effect stays final. A later
// attempt that finds a succeeded effect whose result was dropped
// (stores.Effect.ResultDropped) never calls again: it asks the Resolver for
// the result when there is one (a lookup, not a call), and otherwise Do
// returns a nil result and a nil error, the effect having happened, so a
// replayed message completes instead of failing for bytes the store let
// go. DoResult says which (Done.ResultDropped) and gives the provider key
// to look the effect up at the provider.
//
// # Leases
//
// The attempt that records an effect, or takes it to send it again, holds
// it for a lease (WithLease, three times the call timeout by default),
// counted from the send:
//
//   - While its call runs, the lease is renewed every third of it
//     (stores.EffectStore.Extend), so a slow call is never taken over while
//     its attempt is alive; the lease only bounds how long a dead attempt
//     (a crash, a frozen process) goes unnoticed. A lease that cannot be
//     renewed (another attempt took the effect over, or the store could not
//     be reached before the lease ran out) is lost: the call's context is
//     cancelled, the loss is logged and counted (MetricLeasesLost), and Do's
//     error matches ErrLeaseLost.
//   - A call that ends without an answer leaves the effect unknown with
//     that lease still on it: until it passes, the request may still reach
//     the provider and be acted on, and a status lookup could answer
//     NotFound for a request on its way. No attempt looks the effect up nor
//     sends it again before then (stores.Effect.Landing). A call that said
//     its request never left (NotSent) is sent again at once.
//   - An attempt that finds the effect held by another attempt, or landing,
//     waits for it, looking again with growing pauses (20ms up to 250ms)
//     for up to WithParkWait (a second by default), as the idempotency
//     middleware waits for a message claimed by another delivery; then it
//     is parked with idempotency.ErrInFlight, which the router nacks and
//     the broker redelivers. A broker that hands a nacked message straight
//     back thus runs the handler about once per wait, not thousands of
//     times a second, while the lease runs out.
//   - An operator's resolution (Runner.Resolve, bq-idempotency effects
//     resolve) waits the same way: an effect pending within its holder's
//     lease, or landing, is not resolved, and the error
//     (ErrEffectInFlight) says until when; WithForce resolves it anyway. A
//     call under way whose effect was settled meanwhile (forced, or by a
//     callback) is not cancelled: it runs on, and its answer is recorded
//     against the settlement.
//
// # The provider's word and an operator's
//
// An operator resolves without the provider's answer. When that answer
// comes after all (the call under way returns, a callback, a status
// lookup) and says the effect succeeded, it overrules the resolution: the
// effect becomes succeeded with the provider's result (replacing a failed,
// or a result the operator gave), its note keeping the resolution it
// replaced, logged at error and counted (MetricOperatorConflicts, outcome
// "overruled"; a callback's CallbackResult says CallbackOverruled). So a
// charge the provider made is never recorded as failed for good, and Do
// returns its result, not ErrFailed. The provider's failure against an
// operator's succeeded keeps the resolution (the operator may have had the
// effect done another way), and is logged at error and counted (outcome
// "kept") for someone to look at.
//
// The effect's lease and the message's claim lease (idempotency.WithClaim)
// are separate, and both are renewed while their holder works. The claim
// lease bounds how long a dead delivery holds its message: keep it short,
// so that another consumer takes a crashed one's messages over quickly.
// The effect's lease also bounds how long the provider may take to act on
// a request it received: keep it above that (a provider that queues its
// work may act seconds after the request), and above the call timeout, which
// New requires. A redelivery that takes a dead delivery's message over
// finds its effect held, or its request landing, until the effect's lease
// passes: it waits, is parked, and comes back until then, and then
// reconciles. So a crashed attempt's effect is settled after the longer of
// the two leases.
//
// # Provider keys over HTTP
//
// The key a Call receives is meant for the provider's idempotency key,
// usually the request header Idempotency-Key. Mind what Go's net/http does
// with that header: http.Transport counts a POST carrying an
// "Idempotency-Key" or "X-Idempotency-Key" header as safe to replay, and
// sends it again on its own, without the Call seeing the first failure,
// when the kept-alive connection it went out on dies before the reply (the
// provider may have acted on the first sending) and the body can be
// rewound (http.NewRequest sets GetBody for a bytes or strings reader). To
// a provider that deduplicates keys (the one Resubmit is for) the resend is
// one more request under the same key, and harmless. To a provider that
// ignores keys it is a second charge that the effect record never saw: for
// such a provider send the key, if at all, under a header name of the
// provider's own, never one of those two, or set the request's GetBody to
// nil, so that a lost reply comes back to Do as an error and the effect is
// reconciled before anything is sent again (Example_providerWithoutKeys;
// TestNetHTTPResendsAPOSTCarryingAnIdempotencyKey shows the resend against
// a local server that drops the connection after acting).
//
// # What it cannot promise
//
// A provider without idempotency keys can still charge twice if a request
// reaches it after a later attempt's lookup said NotFound, that is more than
// the lease after it was sent: keep the lease (WithLease) longer than the
// provider may take to act on a request, or use Park or DeadLetter without a
// NotFound answer. An effect whose outcome could not be recorded after the
// call stays pending; it is reconciled once its lease passes, by a later
// delivery if there is one, and shows in the oldest pending age otherwise.
// A process paused past its lease (SIGSTOP, a long GC pause) before its
// call asks the store, once it runs again, whether the lease is still its
// own (an attempt whose lease was not renewed within two thirds of it
// does so right before the call) and sends nothing if another attempt
// took the effect over meanwhile. A pause inside the call, after the
// request was on its way, cannot be undone: its lease lost, the call's
// context is cancelled as soon as the process runs again, and the store
// refuses its unknown outcome over the attempt that took the effect over
// (evidence, a succeeded or failed answer, is recorded from anyone).
package effects
