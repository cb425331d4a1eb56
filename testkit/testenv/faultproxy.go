package testenv

import (
	"errors"
	"io"
	"net"
	"net/url"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// FaultProxy is a TCP proxy in front of a real server that injects faults
// for tests: it can stop answering (accept connections and read requests,
// never reply), delay every reply, drop one reply and close its
// connection (a reply lost on the way back), or go down altogether (Cut:
// every connection dropped and new ones refused, until Restore). Build it with NewFaultProxy;
// it closes when the test ends.
type FaultProxy struct {
	ln       net.Listener
	upstream string

	Silent    atomic.Bool  // connections accepted from now on are read and never answered; lowered, those connections are closed
	Delay     atomic.Int64 // nanoseconds every reply is held back (lifted at once for the replies held when it is lowered)
	DropReply atomic.Bool  // drop the next reply and close its connection
	Dropped   atomic.Int64 // replies dropped

	closed chan struct{}
	mu     sync.Mutex
	down   bool
	conns  map[net.Conn]struct{}
	wg     sync.WaitGroup
}

// PostgresProxyDSN starts a fault proxy in front of the PostgreSQL server
// of POSTGRES_DSN (skipping the test, or failing it under CI, when that
// server is not there) and returns the DSN that reaches it through the
// proxy, for either driver, and the proxy. POSTGRES_DSN must be a
// postgres:// URL.
func PostgresProxyDSN(t testing.TB) (string, *FaultProxy) {
	t.Helper()
	Postgres(t)
	u, err := url.Parse(Getenv("POSTGRES_DSN", DefaultPostgresDSN))
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		t.Fatal("POSTGRES_DSN is not a postgres:// URL: a proxy cannot be put in front of its server")
	}
	host, port := u.Hostname(), u.Port()
	if host == "" {
		host = "localhost"
	}
	if port == "" {
		port = "5432"
	}
	proxy := NewFaultProxy(t, net.JoinHostPort(host, port))
	u.Host = proxy.Addr()
	return u.String(), proxy
}

// NewFaultProxy starts a proxy to upstream (host:port) on a free local port.
func NewFaultProxy(t testing.TB, upstream string) *FaultProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &FaultProxy{ln: ln, upstream: upstream, closed: make(chan struct{}), conns: map[net.Conn]struct{}{}}
	p.wg.Go(p.serve)
	t.Cleanup(p.close)
	return p
}

// Addr is the proxy's address (host:port).
func (p *FaultProxy) Addr() string { return p.ln.Addr().String() }

func (p *FaultProxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.conns == nil {
		_ = c.Close()
		return false
	}
	if p.down {
		_ = c.Close()
		return true // refused; the proxy goes on
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *FaultProxy) serve() {
	for {
		client, err := p.ln.Accept()
		if err != nil {
			return
		}
		if !p.track(client) {
			return
		}
		if p.isDown() {
			continue
		}
		if p.Silent.Load() {
			p.wg.Go(func() { p.silence(client) })
			continue
		}
		server, err := net.Dial("tcp", p.upstream)
		if err != nil {
			_ = client.Close()
			continue
		}
		if !p.track(server) {
			return
		}
		p.wg.Go(func() {
			_, _ = io.Copy(server, client)
			_ = server.Close()
		})
		p.wg.Go(func() { p.replies(server, client) })
	}
}

// silence reads what the client of a connection accepted while Silent
// sends and never answers, until the proxy answers again (Silent lowered):
// the connection is closed then, as a server that came back would have lost
// it, and its client dials anew. Its requests were read and dropped, so it
// could never be answered.
func (p *FaultProxy) silence(client net.Conn) {
	defer client.Close()
	buf := make([]byte, 32<<10)
	for p.Silent.Load() {
		_ = client.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
		if _, err := client.Read(buf); err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
			return
		}
		select {
		case <-p.closed:
			return
		default:
		}
	}
}

// replies copies the server's replies to the client, applying the faults.
func (p *FaultProxy) replies(server, client net.Conn) {
	defer client.Close()
	defer server.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := server.Read(buf)
		if err != nil {
			return
		}
		if p.DropReply.CompareAndSwap(true, false) {
			p.Dropped.Add(1)
			return // the reply is lost and the connection with it
		}
		// Held while the delay says so: a reply held when the delay is
		// lifted goes out then (the server answers again), not at the end
		// of the delay it was held under.
		for held := time.Now(); ; {
			left := time.Duration(p.Delay.Load()) - time.Since(held)
			if left <= 0 {
				break
			}
			select {
			case <-time.After(min(left, 20*time.Millisecond)):
			case <-p.closed:
				return
			}
		}
		if _, err := client.Write(buf[:n]); err != nil {
			return
		}
	}
}

// Cut drops every connection and refuses new ones until Restore: the
// server looks down.
func (p *FaultProxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.down = true
	for c := range p.conns {
		_ = c.Close()
		delete(p.conns, c)
	}
}

// Restore ends a Cut: new connections reach the server again.
func (p *FaultProxy) Restore() {
	p.mu.Lock()
	p.down = false
	p.mu.Unlock()
}

func (p *FaultProxy) isDown() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.down
}

func (p *FaultProxy) close() {
	close(p.closed)
	_ = p.ln.Close()
	p.mu.Lock()
	for c := range p.conns {
		_ = c.Close()
	}
	p.conns = nil
	p.mu.Unlock()
	p.wg.Wait()
}
