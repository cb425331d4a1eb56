package readme_test

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// markdownLink matches an inline link's target: [text](target).
var markdownLink = regexp.MustCompile(`\]\(([^)\s]+)\)`)

// headingSlug turns a Markdown heading into the anchor GitHub gives it:
// lower case, punctuation dropped, spaces turned into hyphens.
func headingSlug(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(strings.TrimSpace(heading)) {
		switch {
		case r == ' ':
			b.WriteByte('-')
		case r == '-' || r == '_' || r >= 'a' && r <= 'z' || r >= '0' && r <= '9':
			b.WriteRune(r)
		}
	}
	return b.String()
}

// anchors returns the anchors of the headings of a Markdown file.
func anchors(t *testing.T, path string) map[string]bool {
	t.Helper()
	text, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]bool{}
	inCode := false
	for _, line := range strings.Split(string(text), "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			inCode = !inCode
		}
		if !inCode && strings.HasPrefix(line, "#") {
			out[headingSlug(strings.TrimLeft(line, "#"))] = true
		}
	}
	return out
}

// TestLinksResolve checks every relative link of the README and the guides:
// the file or folder it names exists, and an anchor names a heading of the
// Markdown file it points into. A reader following the map of the guides
// never lands on nothing.
func TestLinksResolve(t *testing.T) {
	t.Parallel()
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	checked := 0
	for _, doc := range documents(t, root) {
		text, err := os.ReadFile(filepath.Join(root, doc))
		if err != nil {
			t.Fatal(err)
		}
		inCode := false
		for n, line := range strings.Split(string(text), "\n") {
			if strings.HasPrefix(strings.TrimSpace(line), "```") {
				inCode = !inCode
			}
			if inCode {
				continue
			}
			for _, m := range markdownLink.FindAllStringSubmatch(line, -1) {
				target := m[1]
				if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
					continue
				}
				file, anchor, _ := strings.Cut(target, "#")
				path := filepath.Join(root, doc)
				if file != "" {
					path = filepath.Join(filepath.Dir(path), file)
				}
				checked++
				if _, err := os.Stat(path); err != nil {
					t.Errorf("%s:%d: link %q: %v", doc, n+1, target, err)
					continue
				}
				if anchor != "" && strings.HasSuffix(path, ".md") && !anchors(t, path)[anchor] {
					t.Errorf("%s:%d: link %q: no heading with the anchor #%s in %s", doc, n+1, target, anchor, filepath.Base(path))
				}
			}
		}
	}
	if checked < 30 {
		t.Fatalf("checked %d links; the extraction is broken", checked)
	}
}

// sameAs marks a code block that must be, word for word, the file it names
// (a test that runs with its package's tests): <!-- same as: PATH -->.
var sameAs = regexp.MustCompile(`^<!--\s*same as:\s*(\S+)\s*-->$`)

// TestBlocksMatchTheirFiles checks every block marked <!-- same as: PATH -->
// against the file it names, so that what a guide shows is what runs.
func TestBlocksMatchTheirFiles(t *testing.T) {
	t.Parallel()
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	found := 0
	for _, doc := range documents(t, root) {
		text, err := os.ReadFile(filepath.Join(root, doc))
		if err != nil {
			t.Fatal(err)
		}
		lines := strings.Split(string(text), "\n")
		for i, line := range lines {
			m := sameAs.FindStringSubmatch(strings.TrimSpace(line))
			if m == nil {
				continue
			}
			found++
			if i+1 >= len(lines) || !strings.HasPrefix(lines[i+1], "```") {
				t.Errorf("%s:%d: a same-as comment must stand right before a code fence", doc, i+1)
				continue
			}
			var block []string
			for _, l := range lines[i+2:] {
				if strings.HasPrefix(l, "```") {
					break
				}
				block = append(block, l)
			}
			want, err := os.ReadFile(filepath.Join(root, m[1]))
			if err != nil {
				t.Errorf("%s:%d: %v", doc, i+1, err)
				continue
			}
			if got := strings.Join(block, "\n"); strings.TrimRight(got, "\n") != strings.TrimRight(string(want), "\n") {
				t.Errorf("%s:%d: the block differs from %s; copy the file into the guide again", doc, i+1, m[1])
			}
		}
	}
	if found == 0 {
		t.Fatal("no same-as block found; the testing guide's test is no longer checked")
	}
}
