package main

import (
	"errors"
	"regexp"

	"github.com/go-sql-driver/mysql"

	"github.com/babelqueue/watermill-idempotency/internal/sqlstate"
)

// The table a database says does not exist, in its error's message:
// PostgreSQL's relation "t" and MariaDB's Table 'db.t'.
var (
	pgRelation    = regexp.MustCompile(`relation "([^"]+)" does not exist`)
	mysqlTable    = regexp.MustCompile(`Table '(?:[^'.]+\.)?([^']+)' doesn't exist`)
	mysqlNoSuchTb = uint16(1146) // ER_NO_SUCH_TABLE
)

// missingTable reports whether err is a database's "no such table", and
// which table it names ("" when its message does not say).
func missingTable(err error) (string, bool) {
	if sqlstate.Is(err, sqlstate.UndefinedTable) {
		if m := pgRelation.FindStringSubmatch(err.Error()); m != nil {
			return m[1], true
		}
		return "", true
	}
	var my *mysql.MySQLError
	if errors.As(err, &my) && my.Number == mysqlNoSuchTb {
		if m := mysqlTable.FindStringSubmatch(my.Message); m != nil {
			return m[1], true
		}
		return "", true
	}
	return "", false
}
