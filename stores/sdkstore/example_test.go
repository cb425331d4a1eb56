package sdkstore_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/sdkstore"
)

// A kit consumer beside Go SDK consumers on one Redis: the store writes the
// record the Go SDK reads, and keeps its in-flight claims where the Go SDK
// never looks. The middleware keys records on meta.id alone, as the SDK
// does; a key scoped by handler is refused before any command is sent.
func Example() {
	client := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	defer client.Close()

	store, err := sdkstore.NewGoRedis(client, sdkstore.WithTTL(24*time.Hour))
	if err != nil {
		panic(err)
	}
	guard := idempotency.Middleware(store, idempotency.WithScope(""), idempotency.WithClaim(time.Minute))
	_ = guard // router.AddMiddleware(guard)

	id := "8d0b7a8e-2f64-4c41-9d0e-5b6c7d8e9f00"
	fmt.Println("record:", store.RedisKey(id))
	fmt.Println("claim: ", store.ClaimKey(id))

	_, err = stores.Seen(context.Background(), store, idempotency.Key("orders-handler", id))
	fmt.Println("scoped key refused:", errors.Is(err, sdkstore.ErrScopedKey))
	// Output:
	// record: bq:idemp:8d0b7a8e-2f64-4c41-9d0e-5b6c7d8e9f00
	// claim:  bq:idemp-claim:8d0b7a8e-2f64-4c41-9d0e-5b6c7d8e9f00
	// scoped key refused: true
}

// The PHP SDK's PdoStore table on MariaDB (or PostgreSQL). The constructor
// does not touch the database; Migrate creates the table if the PHP side
// has not, and checks that an existing one compares ids byte for byte. The
// layout keeps a remembered message until it is deleted, so a TTL is
// refused.
func ExampleNewPHPPDO() {
	db, err := sql.Open("mysql", "root@tcp(127.0.0.1:3306)/test")
	if err != nil {
		panic(err)
	}
	defer db.Close()

	_, err = sdkstore.NewPHPPDO(db, sdkstore.MariaDB, sdkstore.WithTTL(time.Hour))
	fmt.Println("TTL refused:", errors.Is(err, sdkstore.ErrInvalidOption))

	store, err := sdkstore.NewPHPPDO(db, sdkstore.MariaDB)
	fmt.Println(store != nil, err)
	// Output:
	// TTL refused: true
	// true <nil>
}
