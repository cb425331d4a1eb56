// Package readme_test builds every Go snippet of the README, so that a
// reader can paste each one as written.
//
// The convention, for whoever edits the README:
//
//   - A ```go block that starts with "package" is a whole program and is
//     built as it stands.
//   - Any other ```go block must be preceded (on the line before the fence,
//     blank lines allowed) by an HTML comment naming its wrapper:
//     <!-- snippet: body --> or <!-- snippet: decl -->.
//   - body: the block is the body of a function returning error, run inside
//     its own scope (it may declare names the function already has). In
//     scope: ctx context.Context, router *message.Router, publisher
//     message.Publisher, subscriber message.Subscriber, redisClient
//     redis.UniversalClient, db *sql.DB, store stores.Store and
//     chargeHandler message.NoPublishHandlerFunc, and wire, the quick
//     start's func(*message.Router, message.Publisher, stores.Store) error.
//   - decl: the block is top-level declarations; invoiceFor(envelope.Envelope)
//     any is declared beside it.
//   - imports: the block is an import declaration; each package it names
//     must exist (it is imported for its side effects only).
//
// Both wrappers import the packages listed in wrapperImports under their
// usual names; a snippet may use any of them without an import line.
package readme_test

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// wrapperImports are the packages a fragment may use, with a use of each so
// that the wrapper compiles whatever the fragment uses.
var wrapperImports = []struct{ path, use string }{
	{"context", "context.Background"},
	{"errors", "errors.New"},
	{"database/sql", "sql.Open"},
	{"net/http", "http.NewServeMux"},
	{"time", "time.Second"},
	{"github.com/ThreeDotsLabs/watermill", "watermill.NewUUID"},
	{"github.com/ThreeDotsLabs/watermill/message", "message.NewMessage"},
	{"github.com/ThreeDotsLabs/watermill/message/router/middleware", "middleware.Recoverer"},
	{"github.com/ThreeDotsLabs/watermill/pubsub/gochannel", "gochannel.NewGoChannel"},
	{"github.com/redis/go-redis/v9", "redis.NewClient"},
	{"github.com/jackc/pgx/v5/pgxpool", "pgxpool.New"},
	{"github.com/jackc/pgx/v5/stdlib", "stdlib.OpenDBFromPool"},
	{"github.com/babelqueue/watermill-idempotency/middleware/idempotency/watermillsql", "watermillsql.Tx"},
	{"github.com/babelqueue/watermill-idempotency/effects", "effects.New"},
	{"github.com/babelqueue/watermill-idempotency/envelope", "envelope.Parse"},
	{"github.com/babelqueue/watermill-idempotency/middleware/deadletter", "deadletter.Middleware"},
	{"github.com/babelqueue/watermill-idempotency/middleware/httpidempotency", "httpidempotency.New"},
	{"github.com/babelqueue/watermill-idempotency/middleware/idempotency", "idempotency.Middleware"},
	{"github.com/babelqueue/watermill-idempotency/stores", "stores.WithTx"},
	{"github.com/babelqueue/watermill-idempotency/stores/memstore", "memstore.New"},
	{"github.com/babelqueue/watermill-idempotency/stores/postgresstore", "postgresstore.New"},
	{"github.com/babelqueue/watermill-idempotency/stores/redisstore", "redisstore.New"},
	{"github.com/babelqueue/watermill-idempotency/stores/sdkstore", "sdkstore.NewGoRedis"},
}

func header() string {
	var b strings.Builder
	b.WriteString("package main\n\nimport (\n")
	for _, imp := range wrapperImports {
		fmt.Fprintf(&b, "\t%q\n", imp.path)
	}
	b.WriteString(")\n\n")
	for _, imp := range wrapperImports {
		fmt.Fprintf(&b, "var _ = %s\n", imp.use)
	}
	return b.String()
}

// blankImports turns every import of an import declaration into a blank
// one, so that the declaration compiles without uses.
func blankImports(code string) string {
	var b strings.Builder
	for _, line := range strings.Split(code, "\n") {
		trimmed := strings.TrimSpace(line)
		if i := strings.Index(trimmed, `"`); i >= 0 && !strings.HasPrefix(trimmed, "import") && !strings.HasPrefix(trimmed, "//") {
			line = "\t_ " + trimmed[i:]
		}
		b.WriteString(line + "\n")
	}
	return b.String()
}

const bodyWrapper = `
func main() { _ = snippet(context.Background(), nil, nil, nil, nil, nil, nil, nil, nil) }

func snippet(ctx context.Context, router *message.Router, publisher message.Publisher,
	subscriber message.Subscriber, redisClient redis.UniversalClient, db *sql.DB,
	store stores.Store, chargeHandler message.NoPublishHandlerFunc,
	wire func(*message.Router, message.Publisher, stores.Store) error) error {
	_, _, _, _, _, _, _, _, _ = ctx, router, publisher, subscriber, redisClient, db, store, chargeHandler, wire
	{
%s
	}
	return nil
}
`

const declWrapper = `
func main() {}

func invoiceFor(order envelope.Envelope) any { return order.Data }

%s
`

// snippet is one ```go block of the README.
type snippet struct {
	line    int    // of the opening fence
	wrapper string // "", "body" or "decl"
	code    string
}

var snippetComment = regexp.MustCompile(`^<!--\s*snippet:\s*(\w+)\s*-->$`)

// extract returns the ```go blocks of the Markdown text of doc, with the wrapper each names.
func extract(t *testing.T, doc, readme string) []snippet {
	t.Helper()
	var out []snippet
	lines := strings.Split(readme, "\n")
	for i := 0; i < len(lines); i++ {
		fence := strings.TrimSpace(lines[i])
		if fence != "```go" {
			continue
		}
		indent := lines[i][:strings.Index(lines[i], "```")]
		s := snippet{line: i + 1}
		for j := i - 1; j >= 0; j-- {
			prev := strings.TrimSpace(lines[j])
			if prev == "" {
				continue
			}
			if m := snippetComment.FindStringSubmatch(prev); m != nil {
				s.wrapper = m[1]
			}
			break
		}
		var code []string
		for i++; i < len(lines) && strings.TrimSpace(lines[i]) != "```"; i++ {
			code = append(code, strings.TrimPrefix(lines[i], indent))
		}
		if i == len(lines) {
			t.Fatalf("%s:%d: the go block is never closed", doc, s.line)
		}
		s.code = strings.Join(code, "\n")
		out = append(out, s)
	}
	return out
}

// documents returns the Markdown files whose snippets and links are
// checked: the README, the CHANGELOG and every guide under docs/ and
// docs/brokers/, as paths relative to the module root.
func documents(t *testing.T, root string) []string {
	t.Helper()
	guides, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	brokers, err := filepath.Glob(filepath.Join(root, "docs", "brokers", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	guides = append(guides, brokers...)
	docs := []string{"README.md", "CHANGELOG.md"}
	for _, g := range guides {
		rel, err := filepath.Rel(root, g)
		if err != nil {
			t.Fatal(err)
		}
		docs = append(docs, rel)
	}
	return docs
}

// TestSnippetsBuild builds every Go snippet of README.md and of the guides
// under docs/, wrapped as its HTML comment says, with go build; a snippet
// that does not compile as written fails the test with the compiler's
// message.
func TestSnippetsBuild(t *testing.T) {
	if testing.Short() {
		t.Skip("builds every README and guide snippet")
	}
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	// The snippets are built from an overlay: directories that exist only
	// for the go command, inside the module, so nothing is written to the
	// working tree.
	tmp := t.TempDir()
	replace := map[string]string{}
	var pkgs []string
	total := 0
	for _, doc := range documents(t, root) {
		text, err := os.ReadFile(filepath.Join(root, doc))
		if err != nil {
			t.Fatal(err)
		}
		snippets := extract(t, doc, string(text))
		total += len(snippets)
		name := strings.NewReplacer("/", "_", ".", "_", "-", "_").Replace(doc)
		for _, s := range snippets {
			var src string
			switch {
			case strings.HasPrefix(strings.TrimSpace(s.code), "package "):
				if s.wrapper != "" {
					t.Errorf("%s:%d: a whole program needs no snippet comment", doc, s.line)
				}
				src = s.code + "\n"
			case s.wrapper == "body":
				src = header() + fmt.Sprintf(bodyWrapper, s.code)
			case s.wrapper == "decl":
				src = header() + fmt.Sprintf(declWrapper, s.code)
			case s.wrapper == "imports":
				src = "package main\n\n" + blankImports(s.code) + "\nfunc main() {}\n"
			default:
				t.Errorf("%s:%d: a go fragment without <!-- snippet: body --> or <!-- snippet: decl --> before it", doc, s.line)
				continue
			}
			file := filepath.Join(tmp, fmt.Sprintf("%s-line%d.go", name, s.line))
			if err := os.WriteFile(file, []byte(src), 0o600); err != nil {
				t.Fatal(err)
			}
			dir := fmt.Sprintf("testkit/readme/snippet_%s_%d", name, s.line)
			replace[filepath.Join(root, dir, "main.go")] = file
			pkgs = append(pkgs, "./"+dir)
		}
	}
	if total < 12 {
		t.Fatalf("found %d go blocks in the README and the guides; the extraction is broken", total)
	}
	overlay, err := json.Marshal(map[string]any{"Replace": replace})
	if err != nil {
		t.Fatal(err)
	}
	overlayFile := filepath.Join(tmp, "overlay.json")
	if err := os.WriteFile(overlayFile, overlay, 0o600); err != nil {
		t.Fatal(err)
	}
	// One go build for all: with several main packages it compiles them and
	// writes nothing; errors name testkit/readme/snippet_<file>_<line>.
	cmd := testenv.GoBuild(append([]string{"-overlay", overlayFile}, pkgs...)...)
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("snippets do not build (snippet_<file>_<N> is the block at line N of that file): %v\n%s", err, out)
	}
}
