package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/internal/proccpu"
)

// blockPair is a variant measured against its baseline with -interleave:
// the deliveries of one run take turns, a block of them through kit, the
// next through plain (nil: no middleware), and so on.
type blockPair struct {
	name, baseline string
	kit, plain     message.HandlerMiddleware
	pgx            bool // the handler's transactions on pgx natively
}

// blockReading is what one block of deliveries cost: its CPU time (this
// process, Redis and PostgreSQL) and how long it took.
type blockReading struct {
	kit     bool
	cpu     time.Duration
	elapsed time.Duration
}

// cpuSample is the running totals read at a block's edge.
type cpuSample struct {
	at          time.Time
	self, redis time.Duration
	pg          map[int]time.Duration
}

// runInterleaved measures each pair rounds times, one run of n deliveries
// a round, in blocks of block deliveries that alternate between the
// variant and its baseline (odd rounds start with the baseline, even ones
// with the variant), and reports for every block of the variant the CPU
// per delivery it cost beyond the mean of the two baseline blocks around
// it: the machine's drift over a block is far smaller than over a whole
// run, and a drift at a steady rate cancels in the mean of the two
// neighbours. The first and the last block of a run (the consumers
// starting, the stream's tail) are left out.
func runInterleaved(ctx context.Context, admin *redis.Client, opts *redis.Options, pgProcs proccpu.Postgres, pairs []blockPair, w *work, n, consumers, rounds, block int, runID string) error {
	if n/block < 5 {
		return fmt.Errorf("-interleave %d: want at least 5 blocks in a run of %d deliveries", block, n)
	}
	fmt.Printf("%d messages a run in blocks of %d, %d consumers, %d round(s)\n\n", n, block, consumers, rounds)
	kitCost := make([][]float64, len(pairs)) // µs per delivery beyond the neighbours, per kit block
	share := make([][]float64, len(pairs))   // CPU share of the neighbours, per kit block
	pace := make([][]float64, len(pairs))    // throughput share of the neighbours, per kit block
	for round := 1; round <= rounds; round++ {
		order := make([]int, len(pairs))
		for i := range order {
			order[i] = i
		}
		if round%2 == 0 {
			slices.Reverse(order)
		}
		for _, i := range order {
			p := pairs[i]
			blocks, err := measureBlocks(ctx, admin, opts, pgProcs, p, w, n, consumers, block, round%2 == 0, runID)
			if err != nil {
				return fmt.Errorf("%s: %w", p.name, err)
			}
			var costs []float64
			for b := 2; b < len(blocks)-2; b++ {
				if !blocks[b].kit {
					continue
				}
				before, after := blocks[b-1], blocks[b+1]
				plainCPU := (before.cpu + after.cpu) / 2
				plainTime := (before.elapsed + after.elapsed) / 2
				c := float64((blocks[b].cpu - plainCPU).Microseconds()) / float64(block)
				costs = append(costs, c)
				kitCost[i] = append(kitCost[i], c)
				share[i] = append(share[i], 100*float64(plainCPU)/float64(blocks[b].cpu))
				pace[i] = append(pace[i], 100*float64(plainTime)/float64(blocks[b].elapsed))
			}
			fmt.Fprintf(os.Stderr, "round %d: %s against %s: kit blocks %.0f µs per delivery beyond their neighbours (%s)\n",
				round, p.name, p.baseline, median(costs), formatMicros(costs))
		}
	}
	fmt.Println("| variant | against | kit blocks | kit CPU per delivery, median (95% interval of the median) | CPU share of the neighbours, median | throughput share of the neighbours, median |")
	fmt.Println("|---|---|---:|---:|---:|---:|")
	for i, p := range pairs {
		lo, hi := medianInterval(kitCost[i])
		fmt.Printf("| %s | %s | %d | %.0f µs (%.0f–%.0f) | %.1f%% | %.1f%% |\n", p.name, p.baseline, len(kitCost[i]), median(kitCost[i]), lo, hi, median(share[i]), median(pace[i]))
	}
	return nil
}

// measureBlocks runs n deliveries of a fresh stream, block by block through
// p.kit and p.plain in turn (kitFirst: the first block through p.kit), and
// returns each block's reading.
func measureBlocks(ctx context.Context, admin *redis.Client, opts *redis.Options, pgProcs proccpu.Postgres, p blockPair, w *work, n, consumers, block int, kitFirst bool, runID string) ([]blockReading, error) {
	topic, effect, cleanup, err := prepare(ctx, admin, w, p.pgx, n, runID)
	if err != nil {
		return nil, err
	}
	defer cleanup()
	// Which way a delivery goes is decided by the order it started in: the
	// k-th goes through the kit when its block's turn is the kit's.
	var started atomic.Int64
	kitTurn := func(k int64) bool { return (k/int64(block))%2 == 0 == kitFirst }
	turns := func(h message.HandlerFunc) message.HandlerFunc {
		kh, ph := h, h
		if p.kit != nil {
			kh = p.kit(h)
		}
		if p.plain != nil {
			ph = p.plain(h)
		}
		return func(msg *message.Message) ([]*message.Message, error) {
			if kitTurn(started.Add(1) - 1) {
				return kh(msg)
			}
			return ph(msg)
		}
	}
	var effects atomic.Int64
	sample := func() cpuSample {
		return cpuSample{at: time.Now(), self: processCPU(), redis: redisCPU(ctx, admin), pg: pgProcs.CPU(ctx)}
	}
	samples := []cpuSample{sample()}
	start := time.Now()
	stop, err := consume(ctx, opts, topic, turns, effect, &effects, consumers)
	if err != nil {
		return nil, err
	}
	defer stop()
	// A sample at every block's edge, read as the deliveries counted
	// cross it (the deliveries in flight then, at most one per consumer,
	// count in the block they end in).
	for edge := int64(block); edge < int64(n); edge += int64(block) {
		for effects.Load() < edge {
			if time.Since(start) > 30*time.Minute {
				return nil, fmt.Errorf("not drained")
			}
			time.Sleep(200 * time.Microsecond)
		}
		samples = append(samples, sample())
	}
	if err := drained(ctx, admin, topic, n, start); err != nil {
		return nil, err
	}
	samples = append(samples, sample())
	var blocks []blockReading
	for b := 1; b < len(samples); b++ {
		before, after := samples[b-1], samples[b]
		cpu := after.self - before.self + after.redis - before.redis
		for pid, t := range after.pg {
			cpu += t - before.pg[pid]
		}
		blocks = append(blocks, blockReading{kit: kitTurn(int64(b-1) * int64(block)), cpu: cpu, elapsed: after.at.Sub(before.at)})
	}
	return blocks, nil
}

// median is the median of v (0 for none); v is not changed.
func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Sorted(slices.Values(v))
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// medianInterval is a 95% interval of the median of v, from 4,000
// bootstrap resamples (a fixed seed: the same figures give the same
// interval).
func medianInterval(v []float64) (lo, hi float64) {
	if len(v) == 0 {
		return 0, 0
	}
	rng := rand.New(rand.NewPCG(1, 2))
	const resamples = 4000
	meds := make([]float64, resamples)
	re := make([]float64, len(v))
	for i := range meds {
		for j := range re {
			re[j] = v[rng.IntN(len(v))]
		}
		meds[i] = median(re)
	}
	slices.Sort(meds)
	return meds[resamples*25/1000], meds[resamples*975/1000]
}

// formatMicros lists v as whole µs.
func formatMicros(v []float64) string {
	s := ""
	for i, x := range v {
		if i > 0 {
			s += ", "
		}
		s += fmt.Sprintf("%.0f", x)
	}
	return s
}
