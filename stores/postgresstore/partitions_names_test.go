package postgresstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestPartitionsRollLeavesTablesNotItsOwn: a table in the schema whose
// name only reads as a partition of the partitioned store's (the table of
// another store, in the plain layout, named after it with _p2 and _p3) is
// no partition of it that a cut-short roll detached: the roll leaves it
// alone. It dropped the empty one, and failed on the other, which it
// tried to attach (every DeleteExpired, so no partition was dropped again).
func TestPartitionsRollLeavesTablesNotItsOwn(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	ctx := context.Background()
	s := newPartitioned(t, db, time.Second, time.Second)
	var others []*postgresstore.Store
	for _, suffix := range []string{"_p2", "_p3"} {
		table := s.Table() + suffix
		t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), `DROP TABLE IF EXISTS `+table) })
		o := newStoreOnTable(t, db, table)
		if err := o.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		others = append(others, o)
	}
	if err := others[0].Remember(ctx, "kept", 1, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := s.DeleteExpired(ctx); err != nil {
		t.Errorf("DeleteExpired with tables of other stores named like its partitions: %v", err)
	}
	for _, o := range others {
		var exists bool
		if err := db.QueryRow(`SELECT to_regclass($1) IS NOT NULL`, o.Table()).Scan(&exists); err != nil {
			t.Fatal(err)
		}
		if !exists {
			t.Errorf("the roll of %s dropped %s, another store's table", s.Table(), o.Table())
		}
	}
	if rec, err := others[0].Lookup(ctx, "kept"); err != nil || !rec.Remembered() {
		t.Errorf("the other store's record after the roll: %+v, %v", rec, err)
	}
}
