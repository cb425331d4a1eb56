// Command chart draws the figures of docs/benchmarks.md as SVG from the JSON
// that bench/e2e and bench/scale write:
//
//	go run ./bench/chart -e2e docs/data/e2e.json -scale docs/data/scale.json -out docs
//
// It writes throughput.svg (each variant's throughput as a share of no
// middleware's, measured in the same rounds) and
// latency.svg (p50 and p99 of the first-seen and duplicate paths against the
// number of records, one panel per store).
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"html"
	"io"
	"math"
	"os"
	"path/filepath"
	"strings"
)

type e2eResult struct {
	Variant       string  `json:"variant"`
	Handler       string  `json:"handler"` // "write": the handler writes to PostgreSQL; else it does nothing
	PerSecond     float64 `json:"deliveries_per_second"`
	OfBaselinePct float64 `json:"of_baseline_pct"`
	Rounds        int     `json:"rounds"`
	MinPct        float64 `json:"of_baseline_min_pct"`
	MaxPct        float64 `json:"of_baseline_max_pct"`
}

type scalePoint struct {
	Store      string  `json:"store"`
	Records    int     `json:"records"`
	FirstP50us float64 `json:"first_seen_p50_us"`
	FirstP99us float64 `json:"first_seen_p99_us"`
	DupP50us   float64 `json:"duplicate_p50_us"`
	DupP99us   float64 `json:"duplicate_p99_us"`
}

func main() {
	e2ePath := flag.String("e2e", "docs/data/e2e.json", "bench/e2e results")
	scalePath := flag.String("scale", "docs/data/scale.json", "bench/scale results")
	out := flag.String("out", "docs", "folder for the SVG files")
	flag.Parse()
	if err := run(*e2ePath, *scalePath, *out); err != nil {
		fmt.Fprintln(os.Stderr, "chart:", err)
		os.Exit(1)
	}
}

func run(e2ePath, scalePath, out string) error {
	var e2e []e2eResult
	if err := readJSON(e2ePath, &e2e); err != nil {
		return err
	}
	var scale []scalePoint
	if err := readJSON(scalePath, &scale); err != nil {
		return err
	}
	if err := writeFile(filepath.Join(out, "throughput.svg"), func(w io.Writer) { throughput(w, e2e) }); err != nil {
		return err
	}
	return writeFile(filepath.Join(out, "latency.svg"), func(w io.Writer) { latency(w, scale) })
}

func readJSON(path string, v any) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}

func writeFile(path string, draw func(io.Writer)) error {
	var b strings.Builder
	draw(&b)
	return os.WriteFile(path, []byte(b.String()), 0o644)
}

const font = `font-family="Helvetica,Arial,sans-serif"`

// throughput draws one horizontal bar per variant: its throughput as a
// percentage of no middleware's (the median of the rounds' paired ratios),
// with the range over rounds as a whisker, and the line the kit aims to
// stay above: 80% of no middleware for a handler that does nothing, 90% of
// the handler alone for one that writes to PostgreSQL (-handler write).
func throughput(w io.Writer, results []e2eResult) {
	const width, rowH, left, right, top = 1040, 34, 500, 200, 50
	height := top + rowH*len(results) + 40
	maxPct := 100.0
	rounds := 1
	for _, r := range results {
		maxPct = math.Max(maxPct, math.Max(r.OfBaselinePct, r.MaxPct))
		rounds = max(rounds, r.Rounds)
	}
	scale := float64(width-left-right) / maxPct
	title, goal, goalLabel := "End to end on Redis Streams: throughput, % of no middleware", 80.0, "80% of no middleware"
	if len(results) > 0 && results[0].Handler == "write" {
		title, goal, goalLabel = "A handler that writes to PostgreSQL, on Redis Streams: % of the handler alone", 90, "90% of the handler alone"
	}
	if rounds > 1 {
		title += fmt.Sprintf(" (median of %d rounds)", rounds)
	}
	fmt.Fprintf(w, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d">`+"\n", width, height, width, height)
	fmt.Fprintf(w, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(w, `<text x="%d" y="24" %s font-size="16" font-weight="bold">%s</text>`+"\n", 12, font, html.EscapeString(title))
	for i, r := range results {
		y := top + i*rowH
		bar := r.OfBaselinePct * scale
		color := "#4e79a7"
		if strings.HasPrefix(r.Variant, "kit") {
			color = "#59a14f"
		} else if strings.Contains(r.Variant, "Deduplicator") {
			color = "#e15759"
		}
		name := r.Variant
		if r.Handler == "write" && strings.HasPrefix(name, "no middleware") {
			name = "handler alone" + strings.TrimPrefix(name, "no middleware")
		}
		fmt.Fprintf(w, `<text x="%d" y="%d" %s font-size="13" text-anchor="end">%s</text>`+"\n", left-8, y+17, font, html.EscapeString(name))
		fmt.Fprintf(w, `<rect x="%d" y="%d" width="%.1f" height="%d" fill="%s"/>`+"\n", left, y+3, bar, rowH-10, color)
		label := fmt.Sprintf("%.0f%% · %.0f/s", r.OfBaselinePct, r.PerSecond)
		end := float64(left) + bar
		if r.Rounds > 1 && r.MaxPct > r.MinPct {
			lo, hi := float64(left)+r.MinPct*scale, float64(left)+r.MaxPct*scale
			fmt.Fprintf(w, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#333"/>`+"\n", lo, y+rowH/2-1, hi, y+rowH/2-1)
			label = fmt.Sprintf("%.0f%% (%.0f–%.0f) · %.0f/s", r.OfBaselinePct, r.MinPct, r.MaxPct, r.PerSecond)
			end = math.Max(end, hi)
		}
		fmt.Fprintf(w, `<text x="%.1f" y="%d" %s font-size="12">%s</text>`+"\n", end+6, y+17, font, html.EscapeString(label))
	}
	x := float64(left) + goal*scale
	fmt.Fprintf(w, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#555" stroke-dasharray="4 3"/>`+"\n", x, top-4, x, top+rowH*len(results))
	fmt.Fprintf(w, `<text x="%.1f" y="%d" %s font-size="11" fill="#555" text-anchor="middle">%s</text>`+"\n", x, top+rowH*len(results)+16, font, html.EscapeString(goalLabel))
	fmt.Fprintln(w, `</svg>`)
}

// latency draws, per store, p50 and p99 of both paths against records.
func latency(w io.Writer, points []scalePoint) {
	stores := []string{"redis", "postgres"}
	const panelW, panelH, gap, left, top, bottom = 360, 260, 60, 60, 50, 50
	width := left + len(stores)*(panelW+gap)
	height := top + panelH + bottom + 30
	fmt.Fprintf(w, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d">`+"\n", width, height, width, height)
	fmt.Fprintf(w, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(w, `<text x="12" y="24" %s font-size="16" font-weight="bold">Latency per delivery (µs) against records held</text>`+"\n", font)
	series := []struct {
		name  string
		color string
		dash  string
		value func(scalePoint) float64
	}{
		{"first-seen p50", "#59a14f", "", func(p scalePoint) float64 { return p.FirstP50us }},
		{"first-seen p99", "#59a14f", "5 3", func(p scalePoint) float64 { return p.FirstP99us }},
		{"duplicate p50", "#4e79a7", "", func(p scalePoint) float64 { return p.DupP50us }},
		{"duplicate p99", "#4e79a7", "5 3", func(p scalePoint) float64 { return p.DupP99us }},
	}
	for i, store := range stores {
		var ps []scalePoint
		for _, p := range points {
			if p.Store == store {
				ps = append(ps, p)
			}
		}
		if len(ps) == 0 {
			continue
		}
		x0 := left + i*(panelW+gap)
		maxX, maxY := 0.0, 0.0
		for _, p := range ps {
			maxX = math.Max(maxX, float64(p.Records))
			for _, s := range series {
				maxY = math.Max(maxY, s.value(p))
			}
		}
		maxY *= 1.1
		if maxX == 0 {
			maxX = 1
		}
		px := func(r int) float64 { return float64(x0) + float64(r)/maxX*panelW }
		py := func(v float64) float64 { return float64(top+panelH) - v/maxY*panelH }
		fmt.Fprintf(w, `<text x="%d" y="%d" %s font-size="14" font-weight="bold">%s</text>`+"\n", x0, top-10, font, store)
		fmt.Fprintf(w, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="#333"/>`+"\n", x0, top+panelH, x0+panelW, top+panelH)
		fmt.Fprintf(w, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="#333"/>`+"\n", x0, top, x0, top+panelH)
		for _, p := range ps {
			fmt.Fprintf(w, `<text x="%.1f" y="%d" %s font-size="11" text-anchor="middle">%gM</text>`+"\n", px(p.Records), top+panelH+16, font, float64(p.Records)/1e6)
		}
		for _, frac := range []float64{0, 0.25, 0.5, 0.75, 1} {
			v := frac * maxY
			fmt.Fprintf(w, `<text x="%d" y="%.1f" %s font-size="11" text-anchor="end">%.0f</text>`+"\n", x0-6, py(v)+4, font, v)
			fmt.Fprintf(w, `<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#ddd"/>`+"\n", x0, py(v), x0+panelW, py(v))
		}
		for _, s := range series {
			var path strings.Builder
			for j, p := range ps {
				cmd := "L"
				if j == 0 {
					cmd = "M"
				}
				fmt.Fprintf(&path, "%s%.1f %.1f ", cmd, px(p.Records), py(s.value(p)))
			}
			fmt.Fprintf(w, `<path d="%s" fill="none" stroke="%s" stroke-width="2" stroke-dasharray="%s"/>`+"\n", strings.TrimSpace(path.String()), s.color, s.dash)
		}
		fmt.Fprintf(w, `<text x="%d" y="%d" %s font-size="11">records held</text>`+"\n", x0+panelW/2-30, top+panelH+34, font)
	}
	for j, s := range series {
		x := left + j*170
		y := height - 12
		fmt.Fprintf(w, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="2" stroke-dasharray="%s"/>`+"\n", x, y-4, x+24, y-4, s.color, s.dash)
		fmt.Fprintf(w, `<text x="%d" y="%d" %s font-size="12">%s</text>`+"\n", x+30, y, font, s.name)
	}
	fmt.Fprintln(w, `</svg>`)
}
