package layout

import (
	"path"
	"regexp"
	"strings"
	"testing"
	"unicode"
)

// mdLink matches the target of an inline Markdown link or image: ](target).
var mdLink = regexp.MustCompile(`\]\(([^)\s]+)\)`)

// TestMarkdownLinks fails on a relative link in a tracked Markdown file whose file is not tracked,
// or whose #anchor names no heading of that file.
func TestMarkdownLinks(t *testing.T) {
	_, files := trackedTextFiles(t)
	tracked := map[string][]byte{}
	dirs := map[string]bool{}
	for _, f := range files {
		tracked[f.path] = f.data
		for d := path.Dir(f.path); d != "."; d = path.Dir(d) {
			dirs[d] = true
		}
	}
	checked := 0
	for _, f := range files {
		if !strings.HasSuffix(f.path, ".md") {
			continue
		}
		inFence := false
		lines(f.data, func(n int, line string) {
			if strings.HasPrefix(strings.TrimSpace(line), "```") {
				inFence = !inFence
			}
			if inFence {
				return
			}
			for _, m := range mdLink.FindAllStringSubmatch(line, -1) {
				target := m[1]
				if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
					continue
				}
				file, anchor, _ := strings.Cut(target, "#")
				dest := f.path
				if file != "" {
					dest = path.Clean(path.Join(path.Dir(f.path), file))
				}
				checked++
				data, isFile := tracked[dest]
				if !isFile && !dirs[strings.TrimSuffix(dest, "/")] {
					t.Errorf("%s:%d links to %s, which is not a tracked file or directory", f.path, n, target)
					continue
				}
				if anchor != "" && strings.HasSuffix(dest, ".md") && !anchors(data)[anchor] {
					t.Errorf("%s:%d links to %s, but %s has no heading with the anchor #%s", f.path, n, target, dest, anchor)
				}
			}
		})
	}
	if checked < 10 {
		t.Fatalf("only %d relative links checked: the check would pass vacuously", checked)
	}
}

// anchors returns the anchors a Markdown renderer gives the headings of a document: lower case,
// punctuation removed but for hyphens and underscores, spaces as hyphens, "-1", "-2", … after
// repeats.
func anchors(doc []byte) map[string]bool {
	out := map[string]bool{}
	seen := map[string]int{}
	inFence := false
	lines(doc, func(_ int, line string) {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			inFence = !inFence
		}
		if inFence || !strings.HasPrefix(line, "#") {
			return
		}
		text := strings.TrimSpace(strings.TrimLeft(line, "#"))
		var b strings.Builder
		for _, r := range strings.ToLower(text) {
			switch {
			case unicode.IsLetter(r) || unicode.IsDigit(r) || r == '-' || r == '_':
				b.WriteRune(r)
			case r == ' ':
				b.WriteRune('-')
			}
		}
		a := b.String()
		if k := seen[a]; k > 0 {
			out[a+"-"+itoa(k)] = true
		} else {
			out[a] = true
		}
		seen[a]++
	})
	return out
}

func itoa(n int) string {
	if n == 0 {
		return "0"
	}
	var d []byte
	for ; n > 0; n /= 10 {
		d = append([]byte{byte('0' + n%10)}, d...)
	}
	return string(d)
}

func TestAnchors(t *testing.T) {
	doc := []byte("# Title\n## Security and limits\n```\n# not a heading\n```\n### `GOMAXPROCS=1` with the loop (A/B, not acted on)\n## Limits\n## Limits\n")
	got := anchors(doc)
	for _, want := range []string{"title", "security-and-limits", "gomaxprocs1-with-the-loop-ab-not-acted-on", "limits", "limits-1"} {
		if !got[want] {
			t.Errorf("anchor %q missing from %v", want, got)
		}
	}
	if got["not-a-heading"] {
		t.Errorf("a comment line in a fenced block became an anchor: %v", got)
	}
}
