//go:build !linux

package main

import (
	"context"
	"fmt"

	"github.com/redis/go-redis/v9"
)

// placer supports only the shared placement outside Linux.
type placer struct{}

func newPlacer(_ context.Context, _ *redis.Client, names []string) (*placer, error) {
	for _, n := range names {
		if n != "shared" {
			return nil, fmt.Errorf("-placements %q: only shared is supported on this system (use taskset or its equivalent)", n)
		}
	}
	return &placer{}, nil
}

func (*placer) place(string) error { return nil }

func (*placer) restore() {}
