package testenv

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"
)

// RequireConcurrentMigrations starts replicas together, as a fleet does
// after a deploy: for 2 then 8 replicas, rounds times each, fresh gives a
// schema nobody migrated yet (a table name of its own, dropped when the
// test ends) and returns the Migrate of one replica (a store of its own on
// that schema); every replica's Migrate runs at once and each must
// succeed. A failure names the round and every error seen.
func RequireConcurrentMigrations(t *testing.T, rounds int, fresh func(t *testing.T) (migrate func(ctx context.Context, replica int) error)) {
	t.Helper()
	for _, replicas := range []int{2, 8} {
		for round := range rounds {
			migrate := fresh(t)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			start := make(chan struct{})
			errs := make([]error, replicas)
			var wg sync.WaitGroup
			for i := range replicas {
				wg.Add(1)
				go func() {
					defer wg.Done()
					<-start
					errs[i] = migrate(ctx, i)
				}()
			}
			close(start)
			wg.Wait()
			cancel()
			var failed []string
			for i, err := range errs {
				if err != nil {
					failed = append(failed, fmt.Sprintf("replica %d: %v", i, err))
				}
			}
			if len(failed) > 0 {
				t.Fatalf("%d replicas migrating a fresh schema at once (round %d of %d): %d failed:\n%s",
					replicas, round+1, rounds, len(failed), strings.Join(failed, "\n"))
			}
		}
	}
}
