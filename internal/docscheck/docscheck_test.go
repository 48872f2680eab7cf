package docscheck

import (
	"fmt"
	"io/fs"
	"iter"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"unicode"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// root is the repository, two levels up from this package.
const root = "../.."

// TestLinks checks every relative link of every Markdown file: its target
// exists, and its #fragment, if any, is an anchor of the target page.
func TestLinks(t *testing.T) {
	pages := repoFiles(t, ".md")
	require.Contains(t, pages, "README.md")
	require.Contains(t, pages, "BENCHMARKS.md")
	anchors := map[string]map[string]bool{} // page → its anchors
	for _, p := range pages {
		anchors[p] = headingAnchors(read(t, p))
	}
	checked := 0
	for _, p := range pages {
		for _, l := range links(read(t, p)) {
			if err := checkLink(p, l.target, anchors); err != nil {
				t.Errorf("%s:%d: link %q: %v", p, l.line, l.target, err)
			}
			if _, ok := localTarget(p, l.target); ok {
				checked++
			}
		}
	}
	t.Logf("%d relative links checked in %d pages", checked, len(pages))
}

// TestDocsLinkedFromREADME checks that the README links every page of
// docs/, so that none is found only by browsing the folder.
func TestDocsLinkedFromREADME(t *testing.T) {
	linked := map[string]bool{}
	for _, l := range links(read(t, "README.md")) {
		if target, ok := localTarget("README.md", l.target); ok {
			linked[target] = true
		}
	}
	docs, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	require.NoError(t, err)
	require.NotEmpty(t, docs)
	for _, d := range docs {
		page := "docs/" + filepath.Base(d)
		assert.True(t, linked[page], "README.md does not link %s", page)
	}
}

// TestGoReferences checks the pages that Go files name in their comments
// and messages, such as docs/retries.md ("Defaults"): the page exists, and
// a quoted section after it is one of its headings.
func TestGoReferences(t *testing.T) {
	found := 0
	for _, name := range repoFiles(t, ".go") {
		for _, m := range goReference.FindAllStringSubmatch(read(t, name), -1) {
			found++
			page, section := m[1], m[2]
			if _, err := os.Stat(filepath.Join(root, filepath.FromSlash(page))); err != nil {
				t.Errorf("%s names %s, which does not exist", name, page)
				continue
			}
			if section != "" && !headingAnchors(read(t, page))[slug(section)] {
				t.Errorf("%s names section %q of %s, which has no such heading", name, section, page)
			}
		}
	}
	require.NotZero(t, found, "no Go file names a page: is the pattern stale?")
}

// goReference is a page named from the repository's root in Go source,
// with an optional quoted section: docs/outcome.md ("Did it happen?"), or
// docs/retries.md, "Retry rules". A path inside a URL is not one.
var goReference = regexp.MustCompile(`(?:^|[^/\w.-])((?:README|BENCHMARKS|docs/[\w-]+)\.md)\b(?:,? \(?"([^"]+)"\)?)?`)

// repoFiles lists the repository's files whose names end in ext, relative
// to root with forward slashes; hidden directories and testdata are left
// out.
func repoFiles(t *testing.T, ext string) []string {
	t.Helper()
	var files []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && p != root && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		if !d.IsDir() && strings.HasSuffix(d.Name(), ext) {
			rel, err := filepath.Rel(root, p)
			if err != nil {
				return err
			}
			files = append(files, filepath.ToSlash(rel))
		}
		return nil
	})
	require.NoError(t, err)
	return files
}

func read(t *testing.T, page string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, filepath.FromSlash(page)))
	require.NoError(t, err)
	return string(b)
}

// checkLink checks one link of page. Links with a scheme (https:, mailto:)
// are left alone; a bare #fragment is looked up in page itself.
func checkLink(page, target string, anchors map[string]map[string]bool) error {
	file, ok := localTarget(page, target)
	if !ok {
		return nil
	}
	_, fragment, _ := strings.Cut(target, "#")
	if file == "" || strings.HasPrefix(file, "../") {
		return fmt.Errorf("leaves the repository")
	}
	info, err := os.Stat(filepath.Join(root, filepath.FromSlash(file)))
	if err != nil {
		return fmt.Errorf("no such file: %s", file)
	}
	if fragment == "" {
		return nil
	}
	if info.IsDir() || !strings.HasSuffix(file, ".md") {
		return fmt.Errorf("a #fragment on %s, which is not a Markdown page", file)
	}
	frag, err := url.PathUnescape(fragment)
	if err != nil {
		return err
	}
	if !anchors[file][strings.ToLower(frag)] {
		return fmt.Errorf("%s has no heading whose anchor is #%s", file, frag)
	}
	return nil
}

// localTarget resolves a relative link of page to a path from the
// repository's root (the page itself for a bare #fragment); ok is false
// for a link with a scheme or to an absolute path.
func localTarget(page, target string) (file string, ok bool) {
	if scheme.MatchString(target) || strings.HasPrefix(target, "/") {
		return "", false
	}
	p, _, _ := strings.Cut(target, "#")
	p, _, _ = strings.Cut(p, "?")
	if p == "" {
		return page, true
	}
	if u, err := url.PathUnescape(p); err == nil {
		p = u
	}
	return path.Clean(path.Join(path.Dir(page), p)), true
}

var scheme = regexp.MustCompile(`^[a-zA-Z][a-zA-Z0-9+.-]*:`)

type link struct {
	line   int
	target string
}

var (
	fence      = regexp.MustCompile("^\\s*(```|~~~)")
	codeSpan   = regexp.MustCompile("`+[^`]*`+")
	inlineLink = regexp.MustCompile(`\]\(\s*<?([^()\s<>]*(?:\([^()\s]*\)[^()\s<>]*)*)>?(?:\s+"[^"]*")?\s*\)`)
	refDef     = regexp.MustCompile(`^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$`)
	htmlHref   = regexp.MustCompile(`(?i)<a\s[^>]*href="([^"]*)"`)
)

// links returns the targets of the inline links, reference definitions
// and HTML anchors of a page, outside code blocks and code spans.
func links(text string) []link {
	var out []link
	for i, line := range proseLines(text) {
		line = codeSpan.ReplaceAllString(line, "")
		for _, re := range []*regexp.Regexp{inlineLink, refDef, htmlHref} {
			for _, m := range re.FindAllStringSubmatch(line, -1) {
				if m[1] != "" {
					out = append(out, link{line: i, target: m[1]})
				}
			}
		}
	}
	return out
}

// proseLines yields a page's lines outside fenced code blocks, with their
// line numbers (from 1).
func proseLines(text string) iter.Seq2[int, string] {
	return func(yield func(int, string) bool) {
		inFence := false
		for i, line := range strings.Split(text, "\n") {
			if fence.MatchString(line) {
				inFence = !inFence
				continue
			}
			if !inFence && !yield(i+1, line) {
				return
			}
		}
	}
}

var (
	atxHeading = regexp.MustCompile(`^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$`)
	linkText   = regexp.MustCompile(`!?\[([^\]]*)\]\([^)]*\)`)
	htmlTag    = regexp.MustCompile(`<[^>]+>`)
	htmlID     = regexp.MustCompile(`(?i)<a\s[^>]*(?:name|id)="([^"]+)"`)
)

// headingAnchors returns the anchors GitHub makes for a page's headings
// (and explicit <a name> or id anchors): the heading's text lowercased,
// stripped of everything but letters, digits, spaces, hyphens and
// underscores, spaces made hyphens; a repeated anchor gets -1, -2, ….
func headingAnchors(text string) map[string]bool {
	anchors := map[string]bool{}
	seen := map[string]int{}
	for _, line := range proseLines(text) {
		for _, m := range htmlID.FindAllStringSubmatch(line, -1) {
			anchors[strings.ToLower(m[1])] = true
		}
		m := atxHeading.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		a := slug(m[1])
		if n := seen[a]; n > 0 {
			anchors[fmt.Sprintf("%s-%d", a, n)] = true
		} else {
			anchors[a] = true
		}
		seen[a]++
	}
	return anchors
}

// slug is GitHub's anchor for a heading's Markdown text.
func slug(heading string) string {
	s := linkText.ReplaceAllString(heading, "$1")
	s = htmlTag.ReplaceAllString(s, "")
	s = strings.NewReplacer("`", "", "*", "").Replace(s)
	var b strings.Builder
	for _, r := range strings.ToLower(s) {
		switch {
		case unicode.IsLetter(r), unicode.IsDigit(r), r == '_', r == '-':
			b.WriteRune(r)
		case r == ' ':
			b.WriteRune('-')
		}
	}
	return b.String()
}

// TestSlug pins the anchor rule on headings of these pages.
func TestSlug(t *testing.T) {
	for heading, want := range map[string]string{
		"Retry rules":                "retry-rules",
		"Did it happen?":             "did-it-happen",
		"Follow-up work: the outbox": "follow-up-work-the-outbox",
		"Stored responses: sealed, redacted, bounded":           "stored-responses-sealed-redacted-bounded",
		"Client guidance (publish this with your API)":          "client-guidance-publish-this-with-your-api",
		"The `idempotency_keys` table":                          "the-idempotency_keys-table",
		"[Linked](x.md) *heading*":                              "linked-heading",
		"What is stored, for how long, and how it is protected": "what-is-stored-for-how-long-and-how-it-is-protected",
	} {
		assert.Equal(t, want, slug(heading), heading)
	}
	a := headingAnchors("# A\n## A\n```\n# B\n```\n## A\n")
	assert.Equal(t, map[string]bool{"a": true, "a-1": true, "a-2": true}, a)
}
