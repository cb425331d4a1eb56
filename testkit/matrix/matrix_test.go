package matrix

import (
	"bufio"
	"bytes"
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/redrive"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// parallel is how many broker rows run at once when -parallel is not
// given: the scenarios wait on brokers and deadlines, not on the CPU.
const parallel = 8

func TestMain(m *testing.M) {
	if os.Getenv("MATRIX_ROLE") == "consumer" {
		if err := consumeAsChild(); err != nil {
			fmt.Fprintln(os.Stderr, "consumer:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	flag.Parse()
	given := false
	flag.Visit(func(f *flag.Flag) { given = given || f.Name == "test.parallel" })
	if !given {
		_ = flag.Set("test.parallel", fmt.Sprint(parallel))
	}
	os.Exit(m.Run())
}

// TestMatrix runs every scenario on every broker, each set up as its page
// under docs/brokers shows it, and prints a summary per broker. One
// broker: go test ./testkit/matrix -run 'Matrix/nats'.
func TestMatrix(t *testing.T) {
	sum := newSummary()
	t.Cleanup(func() {
		sum.cli.remove()
		t.Log("\n" + sum.table())
	})
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			t.Parallel()
			for _, sc := range scenarios {
				t.Run(sc.name, func(t *testing.T) {
					if testing.Short() && !sc.short {
						t.Skip("-short: the matrix runs its duplicates and poison scenarios only")
					}
					defer func() {
						if t.Failed() {
							sum.fail(r.name, sc.name)
						}
					}()
					sc.run(t, r, sum)
				})
			}
		})
	}
}

var scenarios = []struct {
	name  string
	short bool
	run   func(t *testing.T, r row, sum *summary)
}{
	{"duplicates", true, duplicates},
	{"poison-flaky", true, poisonAndFlaky},
	{"restart-sigkill", false, restarts},
	{"slow-handler", false, slowHandler},
	{"slow-failing", false, slowFailing},
	{"cli-redrive", false, cliRedrive},
}

// lab is one scenario on one broker.
type lab struct {
	t    *testing.T
	row  row
	sp   spec
	w    *world
	c    *conn // the test's own: its publisher, and the in-process consumers'
	led  ledger
	note string // which store the in-process consumers share, when not the page's
	sum  *summary
}

// newLab sets a scenario up on r. The in-process consumers use the
// page's store when it keeps failures (the retry budget across
// deliveries), and otherwise one memstore they share.
func newLab(t *testing.T, r row, sum *summary) *lab {
	t.Helper()
	sp := spec{Broker: r.name, NS: "bqmatrix_" + testenv.RandomHex(5), Group: "payments"}
	w := r.setup(t, &sp)
	rdb := testenv.Redis(t)
	l := &lab{t: t, row: r, sp: sp, w: w, led: ledger{rdb: rdb, ns: sp.NS}, sum: sum}
	t.Cleanup(func() {
		if err := testenv.DropKeys(context.Background(), rdb, sp.NS+":*"); err != nil {
			t.Errorf("drop %s:*: %v", sp.NS, err)
		}
	})
	if w.inProcess != nil {
		l.c = w.inProcess
		return l
	}
	c, err := open(sp, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.close)
	if !c.store.Capabilities().Failures {
		l.note = fmt.Sprintf("%T keeps no failures: in-process consumers share a memstore", c.store)
		c.store = memstore.New()
	}
	l.c = c
	return l
}

// consumer starts an in-process consumer: a router wired as the page
// shows, with the matrix's handler; stop closes it.
func (l *lab) consumer(b behaviour) (stop func()) {
	l.t.Helper()
	sub, err := l.c.subscriber()
	if err != nil {
		l.t.Fatal(err)
	}
	r, err := message.NewRouter(message.RouterConfig{}, logger())
	if err != nil {
		l.t.Fatal(err)
	}
	if err := l.c.wire(r, l.led.observer()); err != nil {
		l.t.Fatal(err)
	}
	r.AddConsumerHandler("charge", l.sp.Topic, sub, handler(l.led, b))
	return testenv.RunRouter(l.t, r)
}

// consumers starts the scenario's consumers: two competing ones, but on
// a GoChannel, which hands every message to every subscriber.
func (l *lab) consumers(b behaviour) {
	l.t.Helper()
	l.consumer(b)
	if l.w.inProcess == nil {
		l.consumer(b)
	}
}

// joinWhileRunning starts a second consumer once the first runs id (none
// on a GoChannel): on Kafka its joining is a rebalance mid-run.
func (l *lab) joinWhileRunning(b behaviour, id string) {
	l.t.Helper()
	if l.w.inProcess != nil {
		return
	}
	l.eventually("the first run of "+id, time.Minute, func() (bool, string) {
		runs, _, _ := l.counts()
		return runs[id] > 0, "not run yet"
	})
	l.consumer(b)
}

// publish publishes one payment of each kind given, copies times each,
// and returns their ids.
func (l *lab) publish(copies int, kinds ...string) []string {
	l.t.Helper()
	ids := make([]string, len(kinds))
	var batch []*message.Message
	for i, kind := range kinds {
		id, msg, err := newPayment(l.sp.Topic, i, kind)
		if err != nil {
			l.t.Fatal(err)
		}
		ids[i] = id
		for range copies {
			batch = append(batch, msg.Copy())
		}
	}
	if err := l.c.pub.Publish(l.sp.Topic, batch...); err != nil {
		l.t.Fatal(err)
	}
	return ids
}

func repeat(kind string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = kind
	}
	return out
}

// counts reads the ledger: runs, effects and notes per id.
func (l *lab) counts() (runs, effects, notes map[string]int) {
	l.t.Helper()
	ctx := context.Background()
	var err error
	if runs, err = l.led.counts(ctx, "runs"); err == nil {
		if effects, err = l.led.counts(ctx, "effects"); err == nil {
			notes, err = l.led.counts(ctx, "notes")
		}
	}
	if err != nil {
		l.t.Fatalf("the ledger: %v", err)
	}
	return runs, effects, notes
}

// deadLetters counts the dead letters per meta.id.
func (l *lab) deadLetters() map[string]int {
	l.t.Helper()
	out := map[string]int{}
	for _, m := range l.w.deadLetters(l.t) {
		e, err := envelope.Parse(m.Payload)
		if err != nil {
			l.t.Fatalf("a dead letter is not an envelope (%v): %s", err, m.Payload)
		}
		out[e.Meta.ID]++
	}
	return out
}

// eventually polls cond until it holds, or fails the test after within
// with what and the state cond describes.
func (l *lab) eventually(what string, within time.Duration, cond func() (bool, string)) {
	l.t.Helper()
	deadline := time.Now().Add(within)
	for {
		ok, state := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			l.t.Fatalf("%s: not within %v: %s", what, within, state)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// want is what a scenario expects of its messages.
type want struct {
	once []string       // charged exactly once
	dead []string       // never charged, dead-lettered exactly once
	runs map[string]int // exact runs, where the scenario knows them
	// redriven: dead-lettered once before a redrive, which took the dead
	// letter off its topic (consumed: none left) or left it (one).
	redriven []string
	consumed bool
}

// settle waits until every message of w is charged or dead-lettered and
// the topic's backlog is empty.
func (l *lab) settle(w want, within time.Duration) {
	l.t.Helper()
	l.eventually("every payment charged or dead-lettered", within, func() (bool, string) {
		runs, effects, notes := l.counts()
		dead := l.deadLetters()
		missing, undead := 0, 0
		var stuck []string
		for _, id := range w.once {
			if effects[id] == 0 {
				missing++
				stuck = append(stuck, fmt.Sprintf("%s ran %d times", id, runs[id]))
			}
		}
		for _, id := range w.dead {
			if dead[id] == 0 {
				undead++
				stuck = append(stuck, fmt.Sprintf("%s ran %d times", id, runs[id]))
			}
		}
		outcomes, _ := l.led.counts(context.Background(), "outcomes")
		return missing == 0 && undead == 0, fmt.Sprintf("%d of %d payments not charged, %d of %d failing ones not dead-lettered (%s; notes %v; decisions %v; backlog %d)",
			missing, len(w.once), undead, len(w.dead), strings.Join(stuck, ", "), notes, outcomes, l.w.backlog(l.t))
	})
	l.eventually("an empty backlog", within, func() (bool, string) {
		n := l.w.backlog(l.t)
		return n == 0, fmt.Sprintf("%d messages not acked", n)
	})
}

// verify checks w against the ledger and the dead-letter topic: no effect
// twice, each failing message dead-lettered once, runs within the budget.
func (l *lab) verify(w want) (runsTotal, effectsTotal, deadTotal int) {
	l.t.Helper()
	runs, effects, notes := l.counts()
	dead := l.deadLetters()
	for id, n := range effects {
		effectsTotal += n
		if n > 1 {
			l.t.Errorf("payment %s charged %d times", id, n)
		}
	}
	for _, n := range runs {
		runsTotal += n
	}
	for _, n := range dead {
		deadTotal += n
	}
	failing := map[string]bool{}
	for _, id := range w.dead {
		failing[id] = true
		if dead[id] != 1 {
			l.t.Errorf("failing payment %s dead-lettered %d times, want once", id, dead[id])
		}
		if effects[id] != 0 {
			l.t.Errorf("failing payment %s charged %d times", id, effects[id])
		}
		if runs[id] > 1+retries.Max {
			l.t.Errorf("failing payment %s ran %d times, over the budget's %d", id, runs[id], 1+retries.Max)
		}
	}
	for _, id := range w.once {
		if effects[id] != 1 {
			l.t.Errorf("payment %s charged %d times, want once", id, effects[id])
		}
	}
	for _, id := range w.redriven {
		failing[id] = true
		if want := map[bool]int{true: 0, false: 1}[w.consumed]; dead[id] != want {
			l.t.Errorf("redriven payment %s: %d dead letters, want %d (one before the redrive, none after)", id, dead[id], want)
		}
	}
	for id, n := range dead {
		if !failing[id] {
			l.t.Errorf("payment %s dead-lettered %d times, but it is not one that fails", id, n)
		}
	}
	for id, n := range w.runs {
		if runs[id] != n {
			l.t.Errorf("payment %s ran %d times, want %d", id, runs[id], n)
		}
	}
	for k, n := range notes {
		l.t.Logf("note: %s: %d", k, n)
	}
	return runsTotal, effectsTotal, deadTotal
}

// record verifies w and adds the scenario's figures to the summary.
func (l *lab) record(scenario string, w want, extra string) {
	l.t.Helper()
	runs, effects, dead := l.verify(w)
	outcomes, _ := l.led.counts(context.Background(), "outcomes")
	var seen []string
	for _, k := range []string{"ended", "retry_later", "park", "exhausted", "reopen", "claim_lost"} {
		if outcomes[k] > 0 {
			seen = append(seen, fmt.Sprintf("%s %d", k, outcomes[k]))
		}
	}
	if l.note != "" {
		extra = strings.TrimSpace(extra + " [" + l.note + "]")
	}
	res := result{runs: runs, effects: effects, dead: dead, outcomes: strings.Join(seen, ", "), extra: extra, failed: l.t.Failed(),
		known: strings.Contains(extra, "KNOWN:")}
	l.sum.add(l.row.name, scenario, res)
	l.t.Logf("%s/%s: %d runs, %d effects, %d dead letters; %s %s", l.row.name, scenario, runs, effects, dead, res.outcomes, extra)
}

// duplicates: 300 payments, every third published twice, two consumers:
// each charged once, nothing failed.
func duplicates(t *testing.T, r row, sum *summary) {
	l := newLab(t, r, sum)
	n := 300
	if testing.Short() {
		n = 30
	}
	l.consumers(behaviour{})
	ids := l.publish(1, repeat(kindOK, n)...)
	var again []string
	for i, id := range ids {
		if i%3 == 0 {
			again = append(again, id)
		}
	}
	// The duplicates: the same envelopes, published again.
	l.republish(ids, again)
	runs := map[string]int{}
	for _, id := range ids {
		runs[id] = 1
	}
	w := want{once: ids, runs: runs}
	l.settle(w, 2*time.Minute)
	l.record("duplicates", w, fmt.Sprintf("%d payments, %d sent twice", n, len(again)))
}

// republish publishes again the payments of ids listed in again, as they
// were first published (same envelope).
func (l *lab) republish(ids, again []string) {
	l.t.Helper()
	index := map[string]int{}
	for i, id := range ids {
		index[id] = i
	}
	var batch []*message.Message
	for _, id := range again {
		e, err := envelope.New(job, payment{I: index[id], Kind: kindOK}, envelope.WithQueue(l.sp.Topic), envelope.WithID(id))
		if err != nil {
			l.t.Fatal(err)
		}
		body, err := e.Marshal()
		if err != nil {
			l.t.Fatal(err)
		}
		batch = append(batch, message.NewMessage(watermill.NewUUID(), body))
	}
	if err := l.c.pub.Publish(l.sp.Topic, batch...); err != nil {
		l.t.Fatal(err)
	}
}

// poisonAndFlaky: a payment that always fails and one that fails twice,
// among healthy ones: the first dead-lettered once after 1+Max runs, the
// second charged once after 3.
func poisonAndFlaky(t *testing.T, r row, sum *summary) {
	l := newLab(t, r, sum)
	l.consumers(behaviour{})
	ids := l.publish(1, append([]string{kindPoison, kindFlaky}, repeat(kindOK, 8)...)...)
	poison, flaky := ids[0], ids[1]
	w := want{once: ids[1:], dead: []string{poison}, runs: map[string]int{poison: 1 + retries.Max, flaky: 3}}
	l.settle(w, time.Minute)
	l.record("poison-flaky", w, "")
}

// slowHandler: a payment whose charge outlasts the broker's deadline,
// with a second consumer joining while it runs: it runs once, its
// context never cancelled; the payments behind it are charged.
func slowHandler(t *testing.T, r row, sum *summary) {
	if r.notSlow != "" {
		sum.add(r.name, "slow-handler", result{extra: "n/a: " + r.notSlow, skipped: true})
		t.Skip(r.notSlow)
	}
	l := newLab(t, r, sum)
	b := behaviour{slow: 6 * time.Second}
	l.consumer(b)
	ids := l.publish(1, append([]string{kindSlow}, repeat(kindOK, 5)...)...)
	l.joinWhileRunning(b, ids[0])
	w := want{once: ids, runs: map[string]int{ids[0]: 1}}
	if r.cancels != "" {
		// The broker cancels the context at its deadline (its page says
		// so): a charge that honours it never succeeds, and must end as a
		// failing message does.
		w = want{once: ids[1:], dead: ids[:1]}
	}
	l.settle(w, time.Minute)
	_, _, notes := l.counts()
	cancelled := notes[ids[0]+" cancelled"]
	switch {
	case r.cancels == "" && cancelled > 0:
		t.Errorf("the slow charge's context was cancelled %d times (%s)", cancelled, r.deadline)
	case r.cancels != "" && cancelled == 0:
		t.Errorf("the slow charge's context was never cancelled, but %s", r.cancels)
	}
	extra := fmt.Sprintf("a %v charge against %s", b.slow, r.deadline)
	if r.cancels != "" {
		extra += fmt.Sprintf("; KNOWN: context cancelled %d times (%s): dead-lettered instead of charged", cancelled, r.cancels)
	}
	l.record("slow-handler", w, extra)
}

// slowFailing: a payment that fails after a while on every run, longer
// than what fits twice in the broker's deadline, followed by healthy
// ones: it runs at most 1+Max times and is dead-lettered once, and the
// payments behind it are charged meanwhile.
func slowFailing(t *testing.T, r row, sum *summary) {
	l := newLab(t, r, sum)
	b := behaviour{slowFail: 1600 * time.Millisecond}
	l.consumer(b)
	started := time.Now()
	ids := l.publish(1, append([]string{kindSlowFail}, repeat(kindOK, 5)...)...)
	l.joinWhileRunning(b, ids[0])
	w := want{once: ids[1:], dead: ids[:1]}
	var behind time.Duration
	l.eventually("the payments behind the slow failing one charged", time.Minute, func() (bool, string) {
		_, effects, _ := l.counts()
		n := 0
		for _, id := range ids[1:] {
			n += effects[id]
		}
		behind = time.Since(started)
		return n >= len(ids)-1, fmt.Sprintf("%d of %d charged", n, len(ids)-1)
	})
	l.settle(w, time.Minute)
	l.record("slow-failing", w, fmt.Sprintf("runs of %v against %s; the 5 behind charged after %.1f s", b.slowFail, r.deadline, behind.Seconds()))
}

// cliRedrive: payments dead-lettered while the gateway is down (one of
// them published twice) are redriven by bq-idempotency redrive once it is
// fixed: each runs once more and is charged once; no new dead letter.
func cliRedrive(t *testing.T, r row, sum *summary) {
	l := newLab(t, r, sum)
	l.consumers(behaviour{})
	ids := l.publish(1, append(repeat(kindRedrive, 3), repeat(kindOK, 3)...)...)
	l.republishAs(ids[0], 0, kindRedrive) // a redelivery of a message that ends: acked as ended
	down := want{once: ids[3:], dead: ids[:3]}
	l.settle(down, time.Minute)
	runsBefore, _, _ := l.counts()
	if err := l.led.rdb.Set(context.Background(), l.led.key("fixed"), "1", 0).Err(); err != nil {
		t.Fatal(err)
	}
	how := l.redrive()
	runs := map[string]int{}
	for _, id := range ids[:3] {
		runs[id] = runsBefore[id] + 1
	}
	w := want{once: ids, runs: runs, redriven: ids[:3], consumed: l.w.redriveConsumes}
	l.settle(w, time.Minute)
	l.record("cli-redrive", w, how)
}

// republishAs publishes the payment id again, as kind.
func (l *lab) republishAs(id string, i int, kind string) {
	l.t.Helper()
	e, err := envelope.New(job, payment{I: i, Kind: kind}, envelope.WithQueue(l.sp.Topic), envelope.WithID(id))
	if err != nil {
		l.t.Fatal(err)
	}
	body, err := e.Marshal()
	if err != nil {
		l.t.Fatal(err)
	}
	if err := l.c.pub.Publish(l.sp.Topic, message.NewMessage(watermill.NewUUID(), body)); err != nil {
		l.t.Fatal(err)
	}
}

// redrive moves the dead letters back: with the command, or with
// redrive.Run in the process (GoChannel).
func (l *lab) redrive() string {
	l.t.Helper()
	if l.row.cli == "" {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		sub, _ := l.c.subscriber()
		rep, err := redrive.Run(ctx, sub, l.c.pub, l.c.dlq, redrive.WithIdleTimeout(time.Second))
		if err != nil || rep.Moved != 3 {
			l.t.Fatalf("redrive.Run: moved %d, %v", rep.Moved, err)
		}
		return "redrive.Run in the process (the command cannot reach a GoChannel)"
	}
	bin := l.sum.cli.path(l.t)
	args := []string{"redrive", "--broker", l.row.cli, "--from", l.c.dlq, "--idle", "2s", "--quiet"}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = append(os.Environ(), l.w.cliEnv...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil || !strings.Contains(out.String(), "3 moved") {
		l.t.Fatalf("bq-idempotency %s: %v\n%s", strings.Join(args, " "), err, out.String())
	}
	return "bq-idempotency " + strings.Join(args[:5], " ") + ": " + strings.TrimSpace(strings.SplitN(out.String(), "\n", 2)[0])
}

// command is the bq-idempotency command, built once for a run of the
// matrix, when a scenario first needs it.
type command struct {
	once sync.Once
	dir  string
	bin  string
	err  error
}

func (c *command) path(t testing.TB) string {
	t.Helper()
	c.once.Do(func() {
		c.dir, c.err = os.MkdirTemp("", "bq-matrix")
		if c.err != nil {
			return
		}
		c.bin = filepath.Join(c.dir, "bq-idempotency")
		out, err := testenv.GoBuild("-o", c.bin, "github.com/babelqueue/watermill-idempotency/cmd/bq-idempotency").CombinedOutput()
		if err != nil {
			c.err = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if c.err != nil {
		t.Fatal(c.err)
	}
	return c.bin
}

func (c *command) remove() {
	if c.dir != "" {
		_ = os.RemoveAll(c.dir)
	}
}

// restarts: consumer processes, each wired as the page shows: one is
// SIGKILLed right after dead letters went out, one SIGKILLed while it
// holds a payment (the takeover timed), one stopped gracefully right
// after a dead letter; no payment charged twice, each failing one
// dead-lettered once.
func restarts(t *testing.T, r row, sum *summary) {
	if r.notRestart != "" {
		sum.add(r.name, "restart-sigkill", result{extra: "n/a: " + r.notRestart, skipped: true})
		t.Skip(r.notRestart)
	}
	l := newLab(t, r, sum)
	if l.note != "" {
		msg := "needs the page's store to keep failures across processes: " + l.note
		sum.add(r.name, "restart-sigkill", result{extra: "skipped: " + msg, skipped: true})
		t.Skip(msg)
	}
	// 1. Dead letters, then a SIGKILL right after them.
	a := l.child("a", false)
	// The poison payments last, so that their dead letters are the last
	// thing the process does: a payment charged and not yet recorded when
	// the SIGKILL lands would be charged again (the window the README
	// names, which only the transactional mode closes, and which
	// testkit/crashtest measures); the kill here meets acks not yet sent
	// and offsets not yet committed instead.
	phase1 := l.publish(1, append(append(repeat(kindOK, 10), kindFlaky), kindPoison, kindPoison)...)
	l.charged("the first process's payments", phase1[:11]...)
	l.afterDeadLetters("the first process's dead letters", phase1[11:]...)
	a.kill()
	// 2. A payment held by a process that is SIGKILLed: the takeover.
	b := l.child("b", true)
	hold := l.publish(1, kindHold)[0]
	b.await("holding "+hold, time.Minute)
	b.kill()
	killed := time.Now()
	c := l.child("c", false)
	var took time.Duration
	l.eventually("the held payment charged elsewhere", time.Minute, func() (bool, string) {
		at, err := l.led.effectAt(context.Background(), hold)
		if err != nil {
			l.t.Fatal(err)
		}
		took = at.Sub(killed)
		return !at.IsZero(), "not yet"
	})
	if took > r.takeoverWithin {
		t.Errorf("takeover after the SIGKILL took %.1f s, over %v", took.Seconds(), r.takeoverWithin)
	}
	// 3. A graceful restart right after a dead letter.
	phase3 := l.publish(1, append([]string{kindPoison, kindFlaky}, repeat(kindOK, 20)...)...)
	l.afterDeadLetters("the third process's dead letter", phase3[0])
	c.stop()
	d := l.child("d", false)
	w := want{once: append(append(append([]string{}, phase1[:11]...), hold), phase3[1:]...), dead: []string{phase1[11], phase1[12], phase3[0]}}
	l.settle(w, 2*time.Minute)
	d.stop()
	sum.takeover(r.name, took)
	l.record("restart-sigkill", w, fmt.Sprintf("takeover %.1f s after SIGKILL (%s)", took.Seconds(), r.takeoverBy))
}

// charged waits until each of ids is charged.
func (l *lab) charged(what string, ids ...string) {
	l.t.Helper()
	l.eventually(what, time.Minute, func() (bool, string) {
		_, effects, _ := l.counts()
		n := 0
		for _, id := range ids {
			if effects[id] > 0 {
				n++
			}
		}
		return n == len(ids), fmt.Sprintf("%d of %d charged", n, len(ids))
	})
}

// afterDeadLetters waits until each of ids is on the dead-letter topic and
// its end is in the store. Between the two (a few milliseconds) a process
// that dies leaves a message whose dead letter is out and whose end is not
// written: its next delivery dead-letters it again without running (the
// kit cannot write the end before the dead letter is out, or a crash
// between them would lose it); the matrix kills right after that window.
func (l *lab) afterDeadLetters(what string, ids ...string) {
	l.t.Helper()
	l.eventually(what, time.Minute, func() (bool, string) {
		dead := l.deadLetters()
		for _, id := range ids {
			if dead[id] == 0 {
				return false, fmt.Sprintf("%s not dead-lettered yet (%d dead letters)", id, len(dead))
			}
			r, err := l.c.store.Lookup(context.Background(), idempotency.Key("charge", id))
			if err != nil {
				l.t.Fatal(err)
			}
			if !r.Ended() {
				return false, fmt.Sprintf("%s dead-lettered, its end not in the store yet (%v)", id, r.State)
			}
		}
		return true, ""
	})
}

// proc is a consumer process: the test binary run again as
// MATRIX_ROLE=consumer.
type proc struct {
	t     *testing.T
	name  string
	cmd   *exec.Cmd
	mu    sync.Mutex
	out   bytes.Buffer
	lines chan string
	done  chan struct{}
}

// child starts a consumer process; holder: it holds the hold payment for
// ever. The process is killed when the test ends, if still running.
func (l *lab) child(name string, holder bool) *proc {
	l.t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	// The consumer logs (kept, shown if the test fails). A data race the
	// race detector finds in it does not end it with exit code 66: the
	// test reads the reports (races).
	cmd.Env = append(append(os.Environ(), l.sp.env()...), "MATRIX_ROLE=consumer", fmt.Sprintf("MATRIX_HOLDER=%t", holder),
		"MATRIX_LOG=1", "GORACE=exitcode=0")
	p := &proc{t: l.t, name: name, cmd: cmd, lines: make(chan string, 16), done: make(chan struct{})}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		l.t.Fatal(err)
	}
	cmd.Stderr = &lockedWriter{p: p}
	if err := cmd.Start(); err != nil {
		l.t.Fatal(err)
	}
	go func() {
		defer close(p.done)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			line := sc.Text()
			p.mu.Lock()
			p.out.WriteString(line + "\n")
			p.mu.Unlock()
			select {
			case p.lines <- line:
			default:
			}
		}
		_ = cmd.Wait()
	}()
	l.t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-p.done
		p.races()
		if l.t.Failed() {
			l.t.Logf("consumer %s said:\n%s", name, p.output())
		}
	})
	p.await("ready", time.Minute)
	return p
}

type lockedWriter struct{ p *proc }

func (w *lockedWriter) Write(b []byte) (int, error) {
	w.p.mu.Lock()
	defer w.p.mu.Unlock()
	return w.p.out.Write(b)
}

func (p *proc) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.out.String()
	if len(s) > 20000 {
		s = "…" + s[len(s)-20000:]
	}
	return s
}

// races fails the test for each data race the race detector reported in
// the process whose racing accesses are in the kit's code; one in a
// dependency alone (watermill-nats closes a subscription's channel while
// a message is sent on it, at shutdown) is logged.
func (p *proc) races() {
	p.mu.Lock()
	out := p.out.String()
	p.mu.Unlock()
	for _, report := range strings.Split(out, "==================") {
		if !strings.Contains(report, "WARNING: DATA RACE") {
			continue
		}
		accesses, _, _ := strings.Cut(report, "\nGoroutine ")
		if strings.Contains(accesses, "babelqueue/watermill-idempotency/") {
			p.t.Errorf("consumer %s: a data race in the kit:%s", p.name, report)
		} else {
			first, _, _ := strings.Cut(strings.TrimSpace(accesses), "\n      ")
			p.t.Logf("consumer %s: a data race in a dependency (%s)", p.name, strings.ReplaceAll(first, "\n", " "))
		}
	}
}

// await waits for the process to say line.
func (p *proc) await(line string, within time.Duration) {
	p.t.Helper()
	timeout := time.After(within)
	for {
		select {
		case got := <-p.lines:
			if got == line {
				return
			}
		case <-p.done:
			p.t.Fatalf("consumer %s ended before it said %q:\n%s", p.name, line, p.output())
		case <-timeout:
			p.t.Fatalf("consumer %s did not say %q within %v:\n%s", p.name, line, within, p.output())
		}
	}
}

// kill sends SIGKILL and waits for the process to end.
func (p *proc) kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
}

// natsClosePanic is how watermill-nats v2.1.3's subscriber panics when it
// closes while a message is being handed over: a send on the channel it
// just closed, in processMessage.
const natsClosePanic = "panic: send on closed channel"

// natsClosePanicSite names where that panic happens, so that no other send
// on a closed channel passes for it.
const natsClosePanicSite = "watermill-nats/v2/pkg/nats.(*Subscriber).processMessage"

// stop sends SIGTERM (a graceful shutdown) and waits for the process to
// end, within a minute.
func (p *proc) stop() {
	p.t.Helper()
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		code := p.cmd.ProcessState.ExitCode()
		out := p.output()
		panicAt := strings.Index(out, natsClosePanic)
		switch {
		case code == 0:
		case code == 2 && panicAt >= 0 && strings.Contains(out[panicAt:], natsClosePanicSite):
			// watermill-nats v2.1.3's own defect: its subscriber closes a
			// channel that a message still being handed over sends on,
			// when it stops. The process ended at SIGTERM as asked; what
			// it had not acked is redelivered, and the effects are checked
			// as for any other stop.
			p.t.Logf("consumer %s, at SIGTERM, hit watermill-nats's panic on closing its subscriber (not this module's)", p.name)
		default:
			p.t.Errorf("consumer %s exited %d after SIGTERM:\n%s", p.name, code, out)
		}
	case <-time.After(time.Minute):
		p.t.Errorf("consumer %s still running a minute after SIGTERM", p.name)
		p.kill()
	}
}

// consumeAsChild is a consumer process: the broker of MATRIX_* wired as
// its page shows, until SIGTERM.
func consumeAsChild() error {
	sp := specFromEnv()
	c, err := open(sp, nil)
	if err != nil {
		return err
	}
	defer c.close()
	opts, err := redisOptions()
	if err != nil {
		return err
	}
	rdb := redis.NewClient(opts)
	defer rdb.Close()
	led := ledger{rdb: rdb, ns: sp.NS}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	sub, err := c.subscriber()
	if err != nil {
		return err
	}
	r, err := message.NewRouter(message.RouterConfig{}, logger())
	if err != nil {
		return err
	}
	if err := c.wire(r, led.observer()); err != nil {
		return err
	}
	var mu sync.Mutex
	r.AddConsumerHandler("charge", sp.Topic, sub, handler(led, behaviour{
		holder: os.Getenv("MATRIX_HOLDER") == "true", out: os.Stdout, outMu: &mu}))
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	select {
	case <-r.Running():
	case err := <-done:
		return err
	}
	mu.Lock()
	fmt.Println("ready")
	mu.Unlock()
	return <-done
}

// summary collects the figures of every scenario for the table TestMatrix
// prints.
type summary struct {
	mu        sync.Mutex
	results   map[string]map[string]result
	takeovers map[string]time.Duration
	cli       *command // and the command the scenarios share
}

type result struct {
	runs, effects, dead    int
	outcomes, extra        string
	skipped, failed, known bool // known: held to what the broker's page says, short of the scenario's goal
}

func newSummary() *summary {
	return &summary{results: map[string]map[string]result{}, takeovers: map[string]time.Duration{}, cli: &command{}}
}

func (s *summary) add(broker, scenario string, r result) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.results[broker] == nil {
		s.results[broker] = map[string]result{}
	}
	s.results[broker][scenario] = r
}

// fail marks a scenario failed, recorded or not (a scenario that stopped
// early records nothing).
func (s *summary) fail(broker, scenario string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.results[broker] == nil {
		s.results[broker] = map[string]result{}
	}
	r, ok := s.results[broker][scenario]
	if !ok {
		r.extra = "stopped: see the test's log"
	}
	r.failed = true
	s.results[broker][scenario] = r
}

func (s *summary) takeover(broker string, d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.takeovers[broker] = d
}

// table is the summary: a line per broker (runs, effects and dead letters
// over its scenarios, the takeover after a SIGKILL), then a line per
// scenario.
func (s *summary) table() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var b strings.Builder
	fmt.Fprintf(&b, "%-13s %6s %8s %6s %9s  %s\n", "broker", "runs", "effects", "dead", "takeover", "scenarios")
	brokers := make([]string, 0, len(s.results))
	for name := range s.results {
		brokers = append(brokers, name)
	}
	sort.Strings(brokers)
	for _, name := range brokers {
		var runs, effects, dead int
		var cells []string
		for _, sc := range scenarios {
			r, ok := s.results[name][sc.name]
			if !ok {
				continue
			}
			runs, effects, dead = runs+r.runs, effects+r.effects, dead+r.dead
			mark := "ok"
			switch {
			case r.failed:
				mark = "FAILED"
			case r.skipped:
				mark = "n/a"
			case r.known:
				mark = "known"
			}
			cells = append(cells, sc.name+" "+mark)
		}
		took := "-"
		if d, ok := s.takeovers[name]; ok {
			took = fmt.Sprintf("%.1f s", d.Seconds())
		}
		fmt.Fprintf(&b, "%-13s %6d %8d %6d %9s  %s\n", name, runs, effects, dead, took, strings.Join(cells, ", "))
	}
	b.WriteString("\n")
	for _, name := range brokers {
		for _, sc := range scenarios {
			r, ok := s.results[name][sc.name]
			if !ok {
				continue
			}
			fmt.Fprintf(&b, "%s/%s: %d runs, %d effects, %d dead letters", name, sc.name, r.runs, r.effects, r.dead)
			if r.outcomes != "" {
				fmt.Fprintf(&b, "; %s", r.outcomes)
			}
			if r.extra != "" {
				fmt.Fprintf(&b, "; %s", r.extra)
			}
			b.WriteString("\n")
		}
	}
	return b.String()
}
