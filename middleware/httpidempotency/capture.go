package httpidempotency

import (
	"net/http"
)

// capture is the ResponseWriter a guarded handler writes to: it keeps the
// status, headers and body so that they can be saved before they are sent.
// Past limit bytes of body it stops keeping: with passThrough it then sends
// what it kept and everything after to the client directly (the handler's
// effect happened, the caller still gets its response); without it (the
// transactional mode, which rolls back) it only counts.
type capture struct {
	w           http.ResponseWriter
	header      http.Header
	status      int
	body        []byte
	limit       int
	passThrough bool
	overflow    bool // the body went past limit
	sent        bool // the response went to the client (passThrough, past limit)
	written     int64
}

func newCapture(w http.ResponseWriter, limit int, passThrough bool) *capture {
	return &capture{w: w, header: make(http.Header), limit: limit, passThrough: passThrough}
}

func (c *capture) Header() http.Header { return c.header }

func (c *capture) WriteHeader(status int) {
	if c.status != 0 || status < 200 { // the first final status wins; 1xx are not kept
		return
	}
	c.status = status
}

func (c *capture) Write(p []byte) (int, error) {
	if c.status == 0 {
		c.WriteHeader(http.StatusOK)
	}
	c.written += int64(len(p))
	if c.sent {
		return c.w.Write(p)
	}
	if len(c.body)+len(p) <= c.limit {
		c.body = append(c.body, p...)
		return len(p), nil
	}
	c.overflow = true
	if !c.passThrough {
		return len(p), nil
	}
	c.sent = true
	c.writeHead(c.w)
	if len(c.body) > 0 {
		if _, err := c.w.Write(c.body); err != nil {
			return 0, err
		}
	}
	c.body = nil
	return c.w.Write(p)
}

// statusCode returns the status the handler wrote (200 when it wrote
// nothing, as net/http does).
func (c *capture) statusCode() int {
	if c.status == 0 {
		return http.StatusOK
	}
	return c.status
}

// writeHead sends the kept headers and status to w.
func (c *capture) writeHead(w http.ResponseWriter) {
	dst := w.Header()
	for k, v := range c.header {
		dst[k] = v
	}
	w.WriteHeader(c.statusCode())
}

// flush sends the kept response to the client, unless it went already.
func (c *capture) flush() {
	if c.sent {
		return
	}
	c.sent = true
	c.writeHead(c.w)
	if len(c.body) > 0 {
		_, _ = c.w.Write(c.body)
	}
}
