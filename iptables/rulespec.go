package iptables

import (
	"fmt"
	"strings"
)

// SplitRule splits a rule as `iptables -S` and `iptables-save` print it into arguments, undoing
// their quoting: a double-quoted string is one argument, and inside it a backslash escapes the
// next character (`"a \"b\""` is `a "b"`).
func SplitRule(line string) ([]string, error) {
	var (
		args    []string
		cur     strings.Builder
		inArg   bool
		inQuote bool
	)
	for i := 0; i < len(line); i++ {
		c := line[i]
		switch {
		case inQuote && c == '\\':
			if i+1 >= len(line) {
				return nil, fmt.Errorf("split rule %q: backslash at end of line", line)
			}
			i++
			cur.WriteByte(line[i])
		case inQuote && c == '"':
			inQuote = false
		case inQuote:
			cur.WriteByte(c)
		case c == '"':
			inQuote, inArg = true, true
		case c == ' ' || c == '\t':
			if inArg {
				args = append(args, cur.String())
				cur.Reset()
				inArg = false
			}
		default:
			cur.WriteByte(c)
			inArg = true
		}
	}
	if inQuote {
		return nil, fmt.Errorf("split rule %q: unterminated quote", line)
	}
	if inArg {
		args = append(args, cur.String())
	}
	return args, nil
}

// Quote returns s as iptables-restore reads one argument: in double quotes, with `"` and `\`
// escaped by a backslash. Line breaks, which no restore input can hold, become spaces.
func Quote(s string) string {
	if !strings.ContainsAny(s, "\"\\\r\n") {
		return `"` + s + `"`
	}
	var b strings.Builder
	b.Grow(len(s) + 4)
	b.WriteByte('"')
	for i := 0; i < len(s); i++ {
		switch c := s[i]; c {
		case '"', '\\':
			b.WriteByte('\\')
			b.WriteByte(c)
		case '\r', '\n':
			b.WriteByte(' ')
		default:
			b.WriteByte(c)
		}
	}
	b.WriteByte('"')
	return b.String()
}

// JoinRule returns args as one iptables-restore line fragment: arguments separated by spaces,
// those with spaces, quotes, backslashes or nothing in them quoted (Quote). SplitRule of the
// result gives args back.
func JoinRule(args []string) string {
	var b strings.Builder
	for i, a := range args {
		if i > 0 {
			b.WriteByte(' ')
		}
		if a == "" || strings.ContainsAny(a, " \t\"\\\r\n") {
			b.WriteString(Quote(a))
		} else {
			b.WriteString(a)
		}
	}
	return b.String()
}
