// Package docs holds kvmapper's documentation and, in this file, the check that keeps it true:
// its links resolve, the tests it names exist, and the commands of the README run as shown.
package docs

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"unicode"
)

// root is the repository's root, from this package's directory.
const root = ".."

// pages returns the Markdown files the check covers: README.md and BENCHMARKS*.md at the root,
// and every page in docs/, as paths relative to this package's directory.
func pages(t *testing.T) []string {
	t.Helper()
	var files []string
	for _, pattern := range []string{"README.md", "BENCHMARKS*.md", "docs/*.md"} {
		m, err := filepath.Glob(filepath.Join(root, pattern))
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, m...)
	}
	if len(files) < 3 {
		t.Fatalf("found only %v: is the check run from docs/?", files)
	}
	return files
}

// page is a Markdown file split into its prose (fenced code blocks blanked out, so that a shell
// comment is not taken for a heading nor a code sample for a link) and its fenced blocks.
type page struct {
	path   string
	prose  string
	blocks []block
}

// block is a fenced code block: its info string (sh, json…), its lines, the line of the file it
// starts on (1-based, the opening fence), and the paragraph of prose after it.
type block struct {
	info  string
	lines []string
	line  int
	after string
}

func readPage(t *testing.T, path string) page {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	p := page{path: path}
	var prose []string
	var cur *block
	lines := strings.Split(string(b), "\n")
	for i, l := range lines {
		trimmed := strings.TrimSpace(l)
		switch {
		case cur == nil && strings.HasPrefix(trimmed, "```"):
			cur = &block{info: strings.TrimPrefix(trimmed, "```"), line: i + 1}
			prose = append(prose, "")
		case cur != nil && trimmed == "```":
			cur.after = paragraphAfter(lines[i+1:])
			p.blocks = append(p.blocks, *cur)
			cur = nil
			prose = append(prose, "")
		case cur != nil:
			cur.lines = append(cur.lines, l)
			prose = append(prose, "")
		default:
			prose = append(prose, l)
		}
	}
	if cur != nil {
		t.Fatalf("%s:%d: a code block that never closes", path, cur.line)
	}
	p.prose = strings.Join(prose, "\n")
	return p
}

// paragraphAfter returns the first paragraph of lines, joined by spaces.
func paragraphAfter(lines []string) string {
	var para []string
	for _, l := range lines {
		l = strings.TrimSpace(l)
		if l == "" {
			if len(para) > 0 {
				break
			}
			continue
		}
		para = append(para, l)
	}
	return strings.Join(para, " ")
}

var (
	headingRE = regexp.MustCompile(`(?m)^#{1,6} +(.+?) *#* *$`)
	// A code span does not cross a blank line; it may cross a line break.
	codeSpanRE = regexp.MustCompile("`[^`]*`")
	linkRE     = regexp.MustCompile(`\]\(([^)\s]+)\)`)
)

// anchors returns the anchors GitHub gives the headings of p: lower case, every character but
// letters, digits, spaces, hyphens and underscores dropped, spaces made hyphens, and -1, -2…
// appended to repeats.
func anchors(p page) map[string]bool {
	seen := map[string]int{}
	out := map[string]bool{}
	for _, m := range headingRE.FindAllStringSubmatch(p.prose, -1) {
		var b strings.Builder
		for _, r := range strings.ToLower(m[1]) {
			switch {
			case r == ' ':
				b.WriteRune('-')
			case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
				b.WriteRune(r)
			}
		}
		a := b.String()
		if n := seen[a]; n > 0 {
			out[fmt.Sprintf("%s-%d", a, n)] = true
		} else {
			out[a] = true
		}
		seen[a]++
	}
	return out
}

// links returns the targets of the Markdown links in p's prose, outside code spans, with the
// line each is on.
func links(p page) (targets []string, lines []int) {
	var paras []string
	for _, para := range strings.Split(p.prose, "\n\n") {
		paras = append(paras, codeSpanRE.ReplaceAllStringFunc(para, func(s string) string {
			return strings.Map(func(r rune) rune {
				if r == '\n' {
					return r
				}
				return ' '
			}, s)
		}))
	}
	text := strings.Join(paras, "\n\n")
	for _, m := range linkRE.FindAllStringSubmatchIndex(text, -1) {
		targets = append(targets, text[m[2]:m[3]])
		lines = append(lines, strings.Count(text[:m[0]], "\n")+1)
	}
	return targets, lines
}

// TestLinksResolve checks every relative link of the README, the benchmark reports and docs/:
// the file it names exists, and its #anchor is a heading of that file.
func TestLinksResolve(t *testing.T) {
	cache := map[string]page{}
	load := func(path string) page {
		if p, ok := cache[path]; ok {
			return p
		}
		p := readPage(t, path)
		cache[path] = p
		return p
	}
	checked := 0
	for _, path := range pages(t) {
		p := load(path)
		targets, lines := links(p)
		for i, target := range targets {
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			file, anchor, _ := strings.Cut(target, "#")
			dest := path
			if file != "" {
				dest = filepath.Join(filepath.Dir(path), file)
			}
			checked++
			if _, err := os.Stat(dest); err != nil {
				t.Errorf("%s:%d: link %q: %v", path, lines[i], target, err)
				continue
			}
			if anchor == "" {
				continue
			}
			if !strings.HasSuffix(dest, ".md") {
				t.Errorf("%s:%d: link %q: an anchor into a file that is not Markdown", path, lines[i], target)
				continue
			}
			if !anchors(load(dest))[anchor] {
				t.Errorf("%s:%d: link %q: %s has no heading with anchor #%s", path, lines[i], target, dest, anchor)
			}
		}
	}
	if checked < 50 {
		t.Errorf("checked only %d links: is the link pattern still right?", checked)
	}
}

// testNameRE finds the names of tests in prose, and the character after each: a name followed by
// *, ( or | is a prefix or part of a -run pattern, and is checked as a prefix.
var testNameRE = regexp.MustCompile(`\b(Test[A-Z][A-Za-z0-9_]*)(.?)`)

// TestNamedTestsExist checks that every test the docs name (as keeping a promise, or as running
// a command's scenario) is a test function of the repository, so that a renamed or removed test
// cannot leave a promise pointing at nothing.
func TestNamedTestsExist(t *testing.T) {
	defined := map[string]bool{}
	funcRE := regexp.MustCompile(`(?m)^func (Test[A-Za-z0-9_]+)\(`)
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && strings.HasPrefix(d.Name(), ".") && path != root {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range funcRE.FindAllStringSubmatch(string(b), -1) {
			defined[m[1]] = true
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	named := 0
	for _, path := range pages(t) {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range testNameRE.FindAllStringSubmatch(string(b), -1) {
			name, next := m[1], m[2]
			named++
			if defined[name] {
				continue
			}
			if strings.ContainsAny(next, "*(|") && hasPrefix(defined, name) {
				continue
			}
			t.Errorf("%s names %s, which is not a test of this repository (renamed? removed?)", path, name)
		}
	}
	if named < 100 {
		t.Errorf("found only %d test names in the docs: is the pattern still right?", named)
	}
}

func hasPrefix(set map[string]bool, prefix string) bool {
	for name := range set {
		if strings.HasPrefix(name, prefix) {
			return true
		}
	}
	return false
}

// codePathRE finds the repository paths the docs cite in code spans: a Go file under a folder
// (`lanes/leaseclock.go`), or a package under internal/.
var codePathRE = regexp.MustCompile("`((?:[a-z0-9_]+/)+[a-z0-9_]+\\.go|internal/[a-z0-9_/]+)`")

// TestCitedCodePathsExist checks that every file and internal package the docs cite by path
// exists, so that a move of the code cannot leave the docs pointing at nothing.
func TestCitedCodePathsExist(t *testing.T) {
	cited := 0
	for _, path := range pages(t) {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range codePathRE.FindAllStringSubmatch(string(b), -1) {
			cited++
			if _, err := os.Stat(filepath.Join(root, m[1])); err != nil {
				t.Errorf("%s cites %s: %v", path, m[1], err)
			}
		}
	}
	if cited < 10 {
		t.Errorf("found only %d cited paths: is the pattern still right?", cited)
	}
}

// TestEveryPageIsLinkedFromTheREADME requires the README to link every page of docs/, so that a
// newcomer who starts at the README can reach each one.
func TestEveryPageIsLinkedFromTheREADME(t *testing.T) {
	readme := readPage(t, filepath.Join(root, "README.md"))
	targets, _ := links(readme)
	linked := map[string]bool{}
	for _, target := range targets {
		file, _, _ := strings.Cut(target, "#")
		linked[filepath.Clean(file)] = true
	}
	docs, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range docs {
		rel, err := filepath.Rel(root, d)
		if err != nil {
			t.Fatal(err)
		}
		if !linked[rel] {
			t.Errorf("README.md does not link %s: add it to the table under Docs", rel)
		}
	}
}
