package main

import (
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// documentedFlags returns, for each command, the flags its documentation
// names: in the command lines of the Go doc comments of the command's
// sources, of the docs and the README ("bq-idempotency effects show
// --output json ..."), in its synopsis, and --output for the commands whose
// help describes a JSON document or which the package doc's Output section
// names.
func documentedFlags(t *testing.T) map[string]map[string][]string {
	t.Helper()
	out := map[string]map[string][]string{}
	add := func(cmd, flag, where string) {
		if out[cmd] == nil {
			out[cmd] = map[string][]string{}
		}
		out[cmd][flag] = append(out[cmd][flag], where)
	}
	var names []string
	for _, c := range commands {
		names = append(names, regexp.QuoteMeta(c.name))
		for _, m := range regexp.MustCompile(`--([a-z][a-z-]*)`).FindAllStringSubmatch(c.synopsis, -1) {
			add(c.name, m[1], "its synopsis")
		}
		if _, ok := jsonShapes[c.name]; ok {
			add(c.name, "output", "its help's JSON document")
		}
	}
	// Longest first: "effects list" before a command named "effects".
	invocation := regexp.MustCompile(`bq-idempotency (` + strings.Join(names, "|") + `)\b([^\n` + "`" + `#|]*)`)
	flagRE := regexp.MustCompile(`(?:^|\s|\[)--([a-z][a-z-]*)`)
	files, _ := filepath.Glob("*.go")
	docs, _ := filepath.Glob("../../docs/*.md")
	files = append(append(files, docs...), "../../README.md")
	for _, file := range files {
		if strings.HasSuffix(file, "_test.go") {
			continue
		}
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		text := string(b)
		if strings.HasSuffix(file, ".go") { // the doc comments only
			var lines []string
			for _, line := range strings.Split(text, "\n") {
				if l := strings.TrimSpace(line); strings.HasPrefix(l, "//") {
					lines = append(lines, strings.TrimPrefix(l, "//"))
				}
			}
			text = strings.Join(lines, "\n")
		}
		for _, m := range invocation.FindAllStringSubmatch(text, -1) {
			for _, f := range flagRE.FindAllStringSubmatch(m[2], -1) {
				add(m[1], f[1], file+": "+strings.TrimSpace(m[0]))
			}
		}
	}
	// The Output section: "with --output json (redrive, inspect, ...)".
	main, err := os.ReadFile("main.go")
	if err != nil {
		t.Fatal(err)
	}
	listed := regexp.MustCompile(`--output json \(([a-z, ]+)\)`).FindSubmatch(main)
	if listed == nil {
		t.Fatal("main.go's Output section does not list the commands that take --output json")
	}
	for _, name := range strings.Split(string(listed[1]), ", ") {
		add(name, "output", "the Output section of the package doc")
	}
	return out
}

// TestEveryDocumentedFlagIsAccepted: every flag a command's documentation
// names is one the command defines (before: effects show's doc described
// --output json, which exited 2, "flag provided but not defined"), and
// every command with a JSON document has it described in its help.
func TestEveryDocumentedFlagIsAccepted(t *testing.T) {
	t.Parallel()
	documented := documentedFlags(t)
	if len(documented) < 5 {
		t.Fatalf("found the documentation of %d commands only: %v", len(documented), documented)
	}
	for name, flags := range documented {
		c := findCommand(name)
		if c == nil {
			t.Errorf("the docs name a command %q that does not exist", name)
			continue
		}
		fs, _, _ := c.flagSet(newRedactor())
		for flag, where := range flags {
			if fs.Lookup(flag) == nil {
				t.Errorf("%s: --%s is documented (%s) but not defined", name, flag, strings.Join(where, "; "))
			}
		}
		if _, ok := flags["output"]; ok && fs.Lookup("output") != nil {
			if _, shape := jsonShapes[name]; !shape {
				t.Errorf("%s takes --output json, but its help does not describe the document", name)
			}
		}
	}
	if _, ok := documented["effects show"]["output"]; !ok {
		t.Error("effects show's --output json is not found in its documentation: the check reads the wrong places")
	}
}

// TestForgetDuplicateIDs: an id named twice is forgotten once and counted
// once: exit 0, as every record named is gone (before: the second was
// reported missing, exit 3).
func TestForgetDuplicateIDs(t *testing.T) {
	t.Parallel()
	store, flags := redisRecords(t)
	flags = append(flags, "--handler", "charge")
	for _, id := range []string{"pay-1", "pay-2"} {
		if err := store.Remember(context.Background(), idempotency.Key("charge", id), 0, nil); err != nil {
			t.Fatal(err)
		}
	}
	if r := run1(t, append(append([]string{"forget"}, flags...), "pay-1", "pay-1")...); r.code != 0 || !strings.Contains(r.stdout, "forgot 1 of 1 record(s)") {
		t.Fatalf("forget A A: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	r := cli(t, nil, "pay-2\npay-2\n", append(append([]string{"forget"}, flags...), "--output", "json")...)
	if r.code != 0 || strings.TrimSpace(r.stdout) != `{"forgotten":1,"requested":1,"missing":[]}` {
		t.Fatalf("forget of an id piped twice: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
}

// TestMissingTableSaysHowToFixIt: inspect, forget and effects list against
// a PostgreSQL table that does not exist say so and how to fix it (the
// table's flag, the store's migration), not only the database's error;
// inspect prints no table header before it.
func TestMissingTableSaysHowToFixIt(t *testing.T) {
	t.Parallel()
	table := "no_such_table_" + testenv.RandomHex(4)
	pg := []string{"--store", "postgres", "--postgres-dsn", postgresDSN(), "--table", table}
	for _, args := range [][]string{
		append(append([]string{"inspect", "--handler", "charge"}, pg...), "id-1"),
		append(append([]string{"forget", "--handler", "charge"}, pg...), "id-1"),
		append([]string{"effects", "list"}, pg...),
		append(append([]string{"effects", "show"}, pg...), "pk-1"),
	} {
		r := run1(t, args...)
		if r.code != 1 || !strings.Contains(r.stderr, `no table "`+table+`"`) || !strings.Contains(r.stderr, "--table") ||
			!strings.Contains(r.stderr, "Migrate") || strings.TrimSpace(r.stdout) != "" {
			t.Errorf("%v: exit %d, want 1 and how to fix it\nstdout: %q\nstderr: %q", args, r.code, r.stdout, r.stderr)
		}
	}
}
