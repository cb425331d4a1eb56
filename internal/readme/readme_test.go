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
//
// Both wrappers import the packages listed in wrapperImports under their
// usual names; a snippet may use any of them without an import line.
package readme_test

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// wrapperImports are the packages a fragment may use, with a use of each so
// that the wrapper compiles whatever the fragment uses.
var wrapperImports = []struct{ path, use string }{
	{"context", "context.Background"},
	{"database/sql", "sql.Open"},
	{"net/http", "http.NewServeMux"},
	{"time", "time.Second"},
	{"github.com/ThreeDotsLabs/watermill", "watermill.NewUUID"},
	{"github.com/ThreeDotsLabs/watermill/message", "message.NewMessage"},
	{"github.com/ThreeDotsLabs/watermill/message/router/middleware", "middleware.Recoverer"},
	{"github.com/ThreeDotsLabs/watermill/pubsub/gochannel", "gochannel.NewGoChannel"},
	{"github.com/redis/go-redis/v9", "redis.NewClient"},
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

// extract returns the README's ```go blocks with the wrapper each names.
func extract(t *testing.T, readme string) []snippet {
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
			t.Fatalf("line %d: the go block is never closed", s.line)
		}
		s.code = strings.Join(code, "\n")
		out = append(out, s)
	}
	return out
}

// TestSnippetsBuild builds every Go snippet of README.md, wrapped as its
// HTML comment says, with go build; a snippet that does not compile as
// written fails the test with the compiler's message.
func TestSnippetsBuild(t *testing.T) {
	if testing.Short() {
		t.Skip("builds every README snippet")
	}
	buildSnippets(t, "README.md", 8)
}

// TestGuideSnippetsBuild builds every Go snippet of the guides under docs/
// as TestSnippetsBuild does the README's.
func TestGuideSnippetsBuild(t *testing.T) {
	if testing.Short() {
		t.Skip("builds every snippet of the guides")
	}
	guides, err := filepath.Glob("../../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, guide := range guides {
		rel, _ := filepath.Rel("../..", guide)
		t.Run(rel, func(t *testing.T) { buildSnippets(t, rel, 0) })
	}
}

// buildSnippets builds the Go snippets of the Markdown file name (relative
// to the module's root), failing when there are fewer than minimum.
func buildSnippets(t *testing.T, name string, minimum int) {
	t.Helper()
	readme, err := os.ReadFile(filepath.Join("../..", name))
	if err != nil {
		t.Fatal(err)
	}
	snippets := extract(t, string(readme))
	if len(snippets) < minimum {
		t.Fatalf("found %d go blocks in %s; the extraction is broken", len(snippets), name)
	}
	if len(snippets) == 0 {
		return
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
	base := strings.NewReplacer("/", "-", ".md", "").Replace(name)
	for _, s := range snippets {
		var src string
		switch {
		case strings.HasPrefix(strings.TrimSpace(s.code), "package "):
			if s.wrapper != "" {
				t.Errorf("%s:%d: a whole program needs no snippet comment", name, s.line)
			}
			src = s.code + "\n"
		case s.wrapper == "body":
			src = header() + fmt.Sprintf(bodyWrapper, s.code)
		case s.wrapper == "decl":
			src = header() + fmt.Sprintf(declWrapper, s.code)
		default:
			t.Errorf("%s:%d: a go fragment without <!-- snippet: body --> or <!-- snippet: decl --> before it", name, s.line)
			continue
		}
		file := filepath.Join(tmp, fmt.Sprintf("%s-line%d.go", base, s.line))
		if err := os.WriteFile(file, []byte(src), 0o600); err != nil {
			t.Fatal(err)
		}
		dir := fmt.Sprintf("internal/readme/snippet-%s-%d", base, s.line)
		replace[filepath.Join(root, dir, "main.go")] = file
		pkgs = append(pkgs, "./"+dir)
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
	// writes nothing; errors name internal/readme/snippet-<file>-<line>.
	cmd := exec.Command("go", append([]string{"build", "-overlay", overlayFile}, pkgs...)...)
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("%s snippets do not build (snippet-<file>-N is the block at line N): %v\n%s", name, err, out)
	}
}
