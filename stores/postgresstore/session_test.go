package postgresstore_test

import (
	"testing"

	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
)

func TestSessionClaimsContract(t *testing.T) { runContract(t, postgresstore.WithSessionClaims()) }
