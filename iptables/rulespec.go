package iptables

import (
	"fmt"
	"strings"
)

// SplitRule splits a rule as `iptables -S` and `iptables-save` print it into arguments, undoing
// their quoting: a double-quoted string is one argument, and inside it a backslash escapes the
// next character (`"a \"b\""` is `a "b"`).
//
// The arguments are substrings of line wherever no escape had to be undone (every argument of
// the rules iptables prints for Kubernetes: a comment like "ns/svc:port" is quoted but has no
// backslash), and the result is allocated once: a restart at 10,000 service ports splits every
// rule of the tables, and one string per argument was most of its garbage. A caller that keeps
// an argument for long keeps line with it: clone it (strings.Clone).
func SplitRule(line string) ([]string, error) {
	args := make([]string, 0, strings.Count(line, " ")+1)
	for i := 0; ; {
		for i < len(line) && (line[i] == ' ' || line[i] == '\t') {
			i++
		}
		if i == len(line) {
			return args, nil
		}
		arg, next, err := splitArg(line, i)
		if err != nil {
			return nil, err
		}
		args = append(args, arg)
		i = next
	}
}

// splitArg reads the argument of line that starts at i (not a blank) and returns it and where
// it ends: a substring of line unless it has an escape, or quoted and unquoted parts joined.
func splitArg(line string, i int) (arg string, next int, err error) {
	simple := true // arg is line[from:to]
	from, to := i, i
	var b []byte // the argument as built, once not simple
	for i < len(line) && line[i] != ' ' && line[i] != '\t' {
		if line[i] != '"' {
			j := i
			for j < len(line) && line[j] != ' ' && line[j] != '\t' && line[j] != '"' {
				j++
			}
			if simple && to == i {
				to = j
			} else {
				b, simple = appendPart(b, simple, line[from:to], line[i:j]), false
			}
			i = j
			continue
		}
		// A quoted part: up to the closing quote, undoing backslash escapes.
		part := i + 1  // where the quoted content starts
		var esc []byte // the content with its escapes undone, once there is one
		j := part
		for ; ; j++ {
			if j >= len(line) {
				return "", 0, fmt.Errorf("split rule %q: unterminated quote", line)
			}
			if line[j] == '"' {
				break
			}
			if line[j] == '\\' {
				if j+1 >= len(line) {
					return "", 0, fmt.Errorf("split rule %q: backslash at end of line", line)
				}
				if esc == nil {
					esc = append(make([]byte, 0, 32), line[i+1:j]...)
				}
				j++
				esc = append(esc, line[j])
				continue
			}
			if esc != nil {
				esc = append(esc, line[j])
			}
		}
		switch {
		case esc == nil && simple && from == to: // the whole argument so far is this quoted part
			from, to = part, j
		case esc == nil:
			b, simple = appendPart(b, simple, line[from:to], line[part:j]), false
		default:
			b, simple = appendPart(b, simple, line[from:to], string(esc)), false
		}
		i = j + 1
	}
	if simple {
		return line[from:to], i, nil // "" for an empty quoted part
	}
	return string(b), i, nil
}

// appendPart adds part to the argument being built in b, starting it with the simple prefix
// when b is new.
func appendPart(b []byte, simple bool, prefix, part string) []byte {
	if simple {
		b = append(b, prefix...)
	}
	return append(b, part...)
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
