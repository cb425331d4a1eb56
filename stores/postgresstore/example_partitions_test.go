package postgresstore_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
)

// Records kept a week in daily partitions: Migrate creates the table and
// the partitions from yesterday to three days ahead, and DeleteExpired,
// run at least daily, creates the next ones and drops a day's partition
// once every record in it expired. It needs the PostgreSQL at POSTGRES_DSN.
func ExampleWithPartitions() {
	ctx := context.Background()
	dsn := os.Getenv("POSTGRES_DSN")
	if dsn == "" {
		dsn = "postgres://postgres@localhost:5432/test?sslmode=disable"
	}
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		panic(err)
	}
	defer db.Close()

	// A partitioned layout needs a TTL: partitions go once their records
	// expired.
	_, err = postgresstore.New(db, postgresstore.WithPartitions(0))
	fmt.Println("without a TTL, ErrInvalidOption:", errors.Is(err, postgresstore.ErrInvalidOption))

	table := "example_parts_" + strings.ToLower(watermill.NewShortUUID())
	defer func() { _, _ = db.ExecContext(ctx, "DROP TABLE IF EXISTS "+table) }()
	store, err := postgresstore.New(db, postgresstore.WithTable(table),
		postgresstore.WithTTL(7*24*time.Hour), postgresstore.WithPartitions(24*time.Hour))
	if err != nil {
		panic(err)
	}
	if err := store.Migrate(ctx); err != nil {
		panic(err)
	}
	var partitions int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM pg_inherits WHERE inhparent = $1::regclass`, table).Scan(&partitions); err != nil {
		panic(err)
	}
	fmt.Println("partitions:", partitions)

	// The store behaves as on the plain table.
	claimed, _, err := store.Claim(ctx, "order-42", time.Minute)
	if err != nil {
		panic(err)
	}
	fmt.Println("first delivery claims:", claimed)
	if err := store.Remember(ctx, "order-42", 0, nil); err != nil {
		panic(err)
	}
	claimed, found, err := store.Claim(ctx, "order-42", time.Minute)
	if err != nil {
		panic(err)
	}
	fmt.Println("redelivery claims:", claimed, "found:", found.State)

	// Nothing has expired yet: nothing is dropped.
	dropped, err := store.DeleteExpired(ctx)
	if err != nil {
		panic(err)
	}
	fmt.Println("rows dropped:", dropped)
	// Output:
	// without a TTL, ErrInvalidOption: true
	// partitions: 5
	// first delivery claims: true
	// redelivery claims: false found: remembered
	// rows dropped: 0
}
