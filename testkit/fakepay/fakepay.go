// Package fakepay is a payment provider of our own, an HTTP server on
// loopback, for the effects example and tests: it charges, keeps a ledger,
// honours idempotency keys (or not), answers status lookups, sends
// callbacks, and can be told to misbehave the way real providers do: time
// out after charging, lose replies, send callbacks twice or out of order.
//
//	POST /charges            {"order_id":…,"amount_cents":…}, header Idempotency-Key: the reference
//	                         201 {"id":"ch_…","order_id":…,"amount_cents":…,"reference":…}
//	                         422 when a key is reused for another body; 402 when declined
//	GET  /charges?reference=R  200 with the charge, 404 when none (with lookups on)
package fakepay

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// Charge is one charge in the ledger.
type Charge struct {
	ID          string `json:"id"`
	OrderID     string `json:"order_id"`
	AmountCents int64  `json:"amount_cents"`
	Reference   string `json:"reference"`
}

// Request is the body of POST /charges.
type Request struct {
	OrderID     string `json:"order_id"`
	AmountCents int64  `json:"amount_cents"`
}

// Event is a callback the provider posts to the webhook URL.
type Event struct {
	ID        string `json:"id"`   // the event's identity
	Type      string `json:"type"` // charge.succeeded, charge.pending
	Reference string `json:"reference"`
	ChargeID  string `json:"charge_id"`
}

// Faults says how the provider misbehaves; each is a probability from 0 to
// 1 per charge request.
type Faults struct {
	// TimeoutAfterCharge charges, then holds the reply until the client
	// gives up (or Hold passes).
	TimeoutAfterCharge float64
	// LoseReply charges, then closes the connection without a reply.
	LoseReply float64
	// DuplicateCallback sends a charge's callback twice.
	DuplicateCallback float64
	// StaleCallback sends a charge.pending event after charge.succeeded.
	StaleCallback float64
	// Hold is how long a timed-out reply is held (default 30s).
	Hold time.Duration
}

// Config configures a Provider.
type Config struct {
	// IdempotentKeys makes a request with a known Idempotency-Key return
	// the first charge instead of charging again. Without it, every
	// request charges.
	IdempotentKeys bool
	// Lookups serves GET /charges?reference=.
	Lookups bool
	// Webhook is where callbacks are posted ("" for none).
	Webhook string
	// DeclineAmount declines charges of exactly that amount (0: none).
	DeclineAmount int64
	// ActAfter makes the provider act on a charge request that long after
	// it arrived, as a provider that queues its work does: until then the
	// charge is not in the ledger (a lookup does not find it) and the reply
	// waits, whether or not the client is still there. Zero: at once.
	ActAfter time.Duration
	Faults   Faults
	// Seed makes the faults repeatable.
	Seed uint64
}

// Provider is a running fake provider.
type Provider struct {
	cfg    Config
	srv    *http.Server
	ln     net.Listener
	stop   chan struct{}
	wg     sync.WaitGroup
	client *http.Client

	mu       sync.Mutex
	rng      *rand.Rand
	ledger   []Charge
	byKey    map[string]int // reference -> ledger index (idempotent keys)
	bodyOf   map[string]Request
	requests int
	acting   int // requests received and not yet acted on (ActAfter)
	faults   map[string]int
}

// Start starts a Provider on a loopback port; Close stops it.
func Start(cfg Config) (*Provider, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	if cfg.Faults.Hold == 0 {
		cfg.Faults.Hold = 30 * time.Second
	}
	p := &Provider{cfg: cfg, ln: ln, stop: make(chan struct{}), byKey: map[string]int{}, bodyOf: map[string]Request{},
		faults: map[string]int{}, rng: rand.New(rand.NewPCG(cfg.Seed, cfg.Seed+1)),
		client: &http.Client{Timeout: 5 * time.Second}}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /charges", p.charge)
	mux.HandleFunc("GET /charges", p.lookup)
	p.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	p.wg.Go(func() { _ = p.srv.Serve(ln) })
	return p, nil
}

// URL is the provider's base URL.
func (p *Provider) URL() string { return "http://" + p.ln.Addr().String() }

// Close stops the provider, its held replies and its callbacks.
func (p *Provider) Close() error {
	close(p.stop)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := p.srv.Shutdown(ctx)
	p.wg.Wait()
	return err
}

// SetFaults changes the faults from now on.
func (p *Provider) SetFaults(f Faults) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if f.Hold == 0 {
		f.Hold = 30 * time.Second
	}
	p.cfg.Faults = f
}

// Ledger returns the charges made, in order.
func (p *Provider) Ledger() []Charge {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]Charge(nil), p.ledger...)
}

// ChargesPerOrder counts the charges of each order.
func (p *Provider) ChargesPerOrder() map[string]int {
	out := map[string]int{}
	for _, c := range p.Ledger() {
		out[c.OrderID]++
	}
	return out
}

// Acting reports how many charge requests were received and not yet acted
// on (ActAfter).
func (p *Provider) Acting() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.acting
}

// Stats reports the charge requests received and the faults injected, by
// kind (timeout, lost_reply, duplicate_callback, stale_callback, replayed).
func (p *Provider) Stats() (requests int, faults map[string]int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := map[string]int{}
	for k, v := range p.faults {
		out[k] = v
	}
	return p.requests, out
}

func (p *Provider) chance(x float64) bool { return x > 0 && p.rng.Float64() < x }

func (p *Provider) charge(w http.ResponseWriter, r *http.Request) {
	var req Request
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<16)).Decode(&req); err != nil || req.OrderID == "" {
		http.Error(w, "bad request", http.StatusBadRequest)
		return
	}
	key := r.Header.Get("Idempotency-Key")
	p.mu.Lock()
	p.requests++
	if wait := p.cfg.ActAfter; wait > 0 {
		p.acting++
		p.mu.Unlock()
		select { // queued: acted on later, whether or not the client waits
		case <-p.stop:
		case <-time.After(wait):
		}
		p.mu.Lock()
		p.acting--
	}
	if i, ok := p.byKey[key]; ok && p.cfg.IdempotentKeys && key != "" {
		if p.bodyOf[key] != req {
			p.mu.Unlock()
			http.Error(w, "idempotency key reused with another request", http.StatusUnprocessableEntity)
			return
		}
		c := p.ledger[i]
		p.faults["replayed"]++
		p.mu.Unlock()
		writeJSON(w, http.StatusOK, c)
		return
	}
	if p.cfg.DeclineAmount != 0 && req.AmountCents == p.cfg.DeclineAmount {
		p.mu.Unlock()
		http.Error(w, `{"error":"card_declined"}`, http.StatusPaymentRequired)
		return
	}
	c := Charge{ID: "ch_" + strconv.Itoa(len(p.ledger)+1), OrderID: req.OrderID, AmountCents: req.AmountCents, Reference: key}
	p.ledger = append(p.ledger, c)
	if key != "" {
		if _, seen := p.byKey[key]; !seen {
			p.byKey[key] = len(p.ledger) - 1
			p.bodyOf[key] = req
		}
	}
	f := p.cfg.Faults
	timeout, lost := p.chance(f.TimeoutAfterCharge), false
	if !timeout {
		lost = p.chance(f.LoseReply)
	}
	dup, stale := p.chance(f.DuplicateCallback), p.chance(f.StaleCallback)
	for name, on := range map[string]bool{"timeout": timeout, "lost_reply": lost, "duplicate_callback": dup, "stale_callback": stale} {
		if on {
			p.faults[name]++
		}
	}
	p.mu.Unlock()

	p.callbacks(c, dup, stale)
	switch {
	case timeout:
		select { // charged; the reply never comes in time
		case <-r.Context().Done():
		case <-p.stop:
		case <-time.After(f.Hold):
		}
		return
	case lost:
		if hj, ok := w.(http.Hijacker); ok {
			if conn, _, err := hj.Hijack(); err == nil {
				_ = conn.Close()
				return
			}
		}
	}
	writeJSON(w, http.StatusCreated, c)
}

// callbacks posts the charge's events, in the background.
func (p *Provider) callbacks(c Charge, dup, stale bool) {
	if p.cfg.Webhook == "" {
		return
	}
	events := []Event{{ID: "evt_" + c.ID + "_succeeded", Type: "charge.succeeded", Reference: c.Reference, ChargeID: c.ID}}
	if dup {
		events = append(events, events[0])
	}
	if stale {
		events = append(events, Event{ID: "evt_" + c.ID + "_pending", Type: "charge.pending", Reference: c.Reference, ChargeID: c.ID})
	}
	p.wg.Go(func() {
		for _, e := range events {
			select {
			case <-p.stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
			body, _ := json.Marshal(e)
			if resp, err := p.client.Post(p.cfg.Webhook, "application/json", bytes.NewReader(body)); err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				_ = resp.Body.Close()
			}
		}
	})
}

func (p *Provider) lookup(w http.ResponseWriter, r *http.Request) {
	if !p.cfg.Lookups {
		http.Error(w, "lookups not supported", http.StatusNotImplemented)
		return
	}
	ref := r.URL.Query().Get("reference")
	p.mu.Lock()
	var found *Charge
	for i := range p.ledger {
		if p.ledger[i].Reference == ref && ref != "" {
			c := p.ledger[i]
			found = &c
			break
		}
	}
	p.mu.Unlock()
	if found == nil {
		http.Error(w, "no such charge", http.StatusNotFound)
		return
	}
	writeJSON(w, http.StatusOK, found)
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

// Client is what a consumer uses to talk to a Provider.
type Client struct {
	BaseURL string
	HTTP    *http.Client
}

// ErrDeclined is matched when the provider declined a charge.
var ErrDeclined = errors.New("card declined")

// Charge sends a charge under key. A 201 or 200 is the charge; 402 is
// ErrDeclined; anything else, or no reply, is an error.
func (c Client) Charge(ctx context.Context, key string, req Request) (Charge, error) {
	body, _ := json.Marshal(req)
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, c.BaseURL+"/charges", bytes.NewReader(body))
	if err != nil {
		return Charge{}, err
	}
	hr.Header.Set("Content-Type", "application/json")
	hr.Header.Set("Idempotency-Key", key)
	return c.do(hr)
}

// Lookup finds the charge under reference key; found is false on a 404.
func (c Client) Lookup(ctx context.Context, key string) (ch Charge, found bool, err error) {
	hr, err := http.NewRequestWithContext(ctx, http.MethodGet, c.BaseURL+"/charges?reference="+key, nil)
	if err != nil {
		return Charge{}, false, err
	}
	ch, err = c.do(hr)
	var se *StatusError
	if errors.As(err, &se) && se.Code == http.StatusNotFound {
		return Charge{}, false, nil
	}
	return ch, err == nil, err
}

// StatusError is an unexpected HTTP status.
type StatusError struct{ Code int }

func (e *StatusError) Error() string { return fmt.Sprintf("provider answered %d", e.Code) }

func (c Client) do(hr *http.Request) (Charge, error) {
	client := c.HTTP
	if client == nil {
		client = http.DefaultClient
	}
	resp, err := client.Do(hr)
	if err != nil {
		return Charge{}, err
	}
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusOK, http.StatusCreated:
		var ch Charge
		err := json.NewDecoder(resp.Body).Decode(&ch)
		return ch, err
	case http.StatusPaymentRequired:
		return Charge{}, ErrDeclined
	}
	return Charge{}, &StatusError{Code: resp.StatusCode}
}
