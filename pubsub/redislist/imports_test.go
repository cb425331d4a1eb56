package redislist_test

import (
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestImportsNoToolAbove: the binding depends on nothing built above it.
// Neither it nor any package of this module it imports, directly or not,
// imports redrive, the middleware or the command (test files aside).
func TestImportsNoToolAbove(t *testing.T) {
	t.Parallel()
	const module = "github.com/babelqueue/watermill-idempotency/"
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	forbidden := []string{"redrive", "middleware", "cmd"}
	seen := map[string]bool{}
	var visit func(pkg, from string)
	visit = func(pkg, from string) {
		if seen[pkg] {
			return
		}
		seen[pkg] = true
		for _, f := range forbidden {
			if pkg == f || strings.HasPrefix(pkg, f+"/") {
				t.Errorf("pubsub/redislist depends on %s (imported by %s)", pkg, from)
			}
		}
		entries, err := os.ReadDir(filepath.Join(root, pkg))
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range entries {
			name := e.Name()
			if e.IsDir() || !strings.HasSuffix(name, ".go") || strings.HasSuffix(name, "_test.go") {
				continue
			}
			file, err := parser.ParseFile(token.NewFileSet(), filepath.Join(root, pkg, name), nil, parser.ImportsOnly)
			if err != nil {
				t.Fatal(err)
			}
			for _, imp := range file.Imports {
				path, _ := strconv.Unquote(imp.Path.Value)
				if rest, ok := strings.CutPrefix(path, module); ok {
					visit(rest, pkg)
				}
			}
		}
	}
	visit("pubsub/redislist", "")
	if len(seen) < 2 {
		t.Fatalf("read only %v: the walk found no import of this module", seen)
	}
}
