package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// example is a run of the example in this process.
type example struct {
	metricsURL string
	out        testenv.SyncBuffer
}

func (e *example) output() string { return e.out.String() }

// startExample runs the example until the test ends, and waits until it
// provoked every condition.
func startExample(t *testing.T) *example {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	e := &example{metricsURL: "http://" + ln.Addr().String() + "/metrics"}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx, &e.out, ln) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("the example ended with %v\n%s", err, e.output())
			}
		case <-time.After(15 * time.Second):
			t.Errorf("the example did not stop within 15s of its context\n%s", e.output())
		}
	})
	testenv.Eventually(t, "the example's provocations", func() bool {
		select {
		case err := <-done:
			t.Fatalf("the example ended early: %v\n%s", err, e.output())
		default:
		}
		return strings.Contains(e.output(), "serving the metrics until interrupted")
	})
	return e
}

// scrape returns the names of the series the example exports now, with
// their sample lines.
func (e *example) scrape(t *testing.T) (names map[string]bool, text string) {
	t.Helper()
	resp, err := http.Get(e.metricsURL)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	names = map[string]bool{}
	for _, line := range strings.Split(string(body), "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		names[line[:strings.IndexAny(line, "{ ")]] = true
	}
	return names, string(body)
}

func TestOperatingExample(t *testing.T) {
	t.Parallel()
	e := startExample(t)
	for _, want := range []string{"provoked: a burst of 12 payload conflicts", "provoked: a charge whose outcome stays unknown",
		"provoked: a handler that hangs holding its claim", "provoked: a claim taken over by another holder"} {
		if !strings.Contains(e.output(), want) {
			t.Fatalf("output lacks %q:\n%s", want, e.output())
		}
	}
	// Every condition shows in the metrics.
	wants := []string{
		`bq_idempotency_deliveries_total{handler="charge-card",`,
		`outcome="conflict"} 12`,
		`bq_effects_budget_exhausted_total{effect="refund",`,
		`bq_deadletter_messages_total{`,
		`reason="unknown_outcome"`,
		`bq_idempotency_claims_in_progress{`,
	}
	var text string
	testenv.Eventually(t, "every condition in the metrics", func() bool {
		_, text = e.scrape(t)
		for _, w := range wants {
			if !strings.Contains(text, w) {
				return false
			}
		}
		return true
	})
}

// metricName matches the metric names of the kit in a PromQL expression.
var metricName = regexp.MustCompile(`\bbq_[a-z_]+\b`)

// TestDashboardQueriesNameExportedMetrics: every query of the Grafana
// dashboard names only metrics a run of this example exports, by their
// exported names.
func TestDashboardQueriesNameExportedMetrics(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile("../../deploy/grafana/watermill-idempotency.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Title   string
			Targets []struct{ Expr string }
		}
	}
	if err := json.Unmarshal(raw, &dash); err != nil {
		t.Fatal(err)
	}
	used := map[string][]string{} // metric -> panels
	queries := 0
	for _, p := range dash.Panels {
		for _, target := range p.Targets {
			queries++
			names := metricName.FindAllString(target.Expr, -1)
			if len(names) == 0 {
				t.Errorf("panel %q: the query %q names no metric of the kit", p.Title, target.Expr)
			}
			for _, n := range names {
				used[n] = append(used[n], p.Title)
			}
		}
	}
	if queries < 10 {
		t.Fatalf("found %d queries in the dashboard; the parsing is broken", queries)
	}
	e := startExample(t)
	// A renewal fails only on a store fault the example does not make; its
	// counter appears on the first one. Its name is checked against the
	// kit's instrument instead.
	onFaultOnly := strings.ReplaceAll(idempotency.MetricRenewalFailures, ".", "_") + "_total"
	if _, ok := used[onFaultOnly]; !ok {
		t.Errorf("the dashboard has no panel of %s", onFaultOnly)
	}
	delete(used, onFaultOnly)
	var missing []string
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		exported, _ := e.scrape(t)
		missing = missing[:0]
		for n := range used {
			if !exported[n] {
				missing = append(missing, n)
			}
		}
		if len(missing) == 0 {
			return
		}
		if time.Now().After(deadline) {
			break
		}
	}
	sort.Strings(missing)
	t.Fatalf("after 30 s, the dashboard queries metrics the example does not export: %v", missing)
}

// needTool returns the path of a Prometheus tool, or skips the test (fails
// it under CI) when it is not installed.
func needTool(t *testing.T, name string) string {
	t.Helper()
	path, err := exec.LookPath(name)
	if err != nil {
		testenv.Unavailable(t, name, err, "install Debian's prometheus package (apt-get install prometheus) for promtool and the Prometheus server")
	}
	return path
}

// TestAlertRules checks the shipped rules and runs their unit tests with
// promtool.
func TestAlertRules(t *testing.T) {
	t.Parallel()
	promtool := needTool(t, "promtool")
	for _, args := range [][]string{
		{"check", "rules", "alerts.yml"},
		{"test", "rules", "alerts_test.yml"},
	} {
		cmd := exec.Command(promtool, args...)
		cmd.Dir = "../../deploy/prometheus"
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}

// testRules returns the shipped rules with their thresholds of minutes cut
// to seconds, so that a test sees them fire: every "for:" becomes 1s, and
// the age thresholds 2s. A replacement that matches nothing fails the test
// (the rules changed; update it).
func testRules(t *testing.T) string {
	t.Helper()
	raw, err := os.ReadFile("../../deploy/prometheus/alerts.yml")
	if err != nil {
		t.Fatal(err)
	}
	rules := string(raw)
	for _, r := range []struct{ old, new string }{
		{"(bq_idempotency_claims_oldest_age_seconds) > 120", "(bq_idempotency_claims_oldest_age_seconds) > 2"},
		{`(bq_effects_oldest_age_seconds{state="unknown"}) > 300`, `(bq_effects_oldest_age_seconds{state="unknown"}) > 2`},
	} {
		if !strings.Contains(rules, r.old) {
			t.Fatalf("deploy/prometheus/alerts.yml no longer has %q", r.old)
		}
		rules = strings.ReplaceAll(rules, r.old, r.new)
	}
	return regexp.MustCompile(`(?m)^(\s+for:) \S+$`).ReplaceAllString(rules, "$1 1s")
}

// TestAlertsFireOnARealPrometheus starts Prometheus (Debian's package)
// scraping a run of the example every second, with the shipped rules (their
// minutes cut to seconds), and waits until each alert of a condition the
// example provokes fires.
func TestAlertsFireOnARealPrometheus(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a Prometheus server and waits for its alerts")
	}
	t.Parallel()
	bin := needTool(t, "prometheus")
	e := startExample(t)
	expected := []string{"BQClaimHeldTooLong", "BQEffectOutcomeUnknown", "BQPayloadConflicts", "BQDeadLetters", "BQEffectBudgetExhausted", "BQClaimsLost"}
	// The claim taken over while its handler runs is found when the
	// handler returns (memstore renews nothing) and counted lost.
	deadline := time.Now().Add(3 * lease)
	for {
		_, text := e.scrape(t)
		if strings.Contains(text, `outcome="claim_lost"`) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the claim taken over was not reported lost (no outcome=\"claim_lost\" within %v)", 3*lease)
		}
		time.Sleep(100 * time.Millisecond)
	}

	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "alerts.yml"), []byte(testRules(t)), 0o600); err != nil {
		t.Fatal(err)
	}
	target := strings.TrimSuffix(strings.TrimPrefix(e.metricsURL, "http://"), "/metrics")
	config := fmt.Sprintf(`global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: [alerts.yml]
scrape_configs:
  - job_name: operating
    static_configs:
      - targets: [%q]
`, target)
	if err := os.WriteFile(filepath.Join(dir, "prometheus.yml"), []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	var logs bytes.Buffer
	cmd := exec.Command(bin, "--config.file="+filepath.Join(dir, "prometheus.yml"),
		"--storage.tsdb.path="+filepath.Join(dir, "data"), "--web.listen-address="+addr, "--log.level=warn")
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
	})

	var firing map[string]bool
	var seen string
	deadline = time.Now().Add(45 * time.Second)
	for {
		select {
		case err := <-exited:
			t.Fatalf("prometheus exited: %v\n%s", err, logs.String())
		default:
		}
		firing, seen = alerts(addr)
		all := true
		for _, name := range expected {
			all = all && firing[name]
		}
		if all {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 45s, want firing %v; Prometheus reports %s\nits log:\n%s", expected, seen, logs.String())
		}
		time.Sleep(250 * time.Millisecond)
	}
	t.Logf("firing: %s", seen)
}

// alerts returns the alerts Prometheus at addr reports firing, and what it
// said (for a failure message).
func alerts(addr string) (map[string]bool, string) {
	resp, err := http.Get("http://" + addr + "/api/v1/alerts")
	if err != nil {
		return nil, err.Error()
	}
	defer resp.Body.Close()
	var body struct {
		Data struct {
			Alerts []struct {
				Labels map[string]string
				State  string
			}
		}
	}
	raw, _ := io.ReadAll(resp.Body)
	if err := json.Unmarshal(raw, &body); err != nil {
		return nil, fmt.Sprintf("%v: %s", err, raw)
	}
	firing := map[string]bool{}
	var states []string
	for _, a := range body.Data.Alerts {
		states = append(states, a.Labels["alertname"]+"="+a.State)
		if a.State == "firing" {
			firing[a.Labels["alertname"]] = true
		}
	}
	sort.Strings(states)
	return firing, "[" + strings.Join(states, " ") + "]"
}

// freeAddr returns a local address nobody listens on.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}
