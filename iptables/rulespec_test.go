package iptables

import (
	"errors"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

func TestSplitRule(t *testing.T) {
	tests := []struct {
		name    string
		line    string
		want    []string
		wantErr bool
	}{
		{name: "plain", line: "-A INPUT -p tcp -j ACCEPT", want: []string{"-A", "INPUT", "-p", "tcp", "-j", "ACCEPT"}},
		{name: "quoted comment with spaces", line: `-A PREROUTING -m comment --comment "handle ClusterIPs; NOTE: first" -j KUBE-X`,
			want: []string{"-A", "PREROUTING", "-m", "comment", "--comment", "handle ClusterIPs; NOTE: first", "-j", "KUBE-X"}},
		{name: "escaped quote and backslash", line: `-A X --comment "a \"b\" \\c"`, want: []string{"-A", "X", "--comment", `a "b" \c`}},
		{name: "empty quoted", line: `-A X --comment ""`, want: []string{"-A", "X", "--comment", ""}},
		{name: "extra spaces", line: "  -A   X  ", want: []string{"-A", "X"}},
		{name: "unterminated quote", line: `-A X --comment "abc`, wantErr: true},
		{name: "trailing backslash", line: `-A X --comment "abc\`, wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := SplitRule(tc.line)
			if (err != nil) != tc.wantErr {
				t.Fatalf("SplitRule(%q) error = %v, want error %v", tc.line, err, tc.wantErr)
			}
			if !tc.wantErr && !slices.Equal(got, tc.want) {
				t.Errorf("SplitRule(%q) = %q, want %q", tc.line, got, tc.want)
			}
		})
	}
}

func TestQuoteRoundTrip(t *testing.T) {
	tests := []struct{ name, in, quoted string }{
		{name: "service name", in: "default/my-nginx:http", quoted: `"default/my-nginx:http"`},
		{name: "spaces", in: "a b", quoted: `"a b"`},
		{name: "quote", in: `a"b`, quoted: `"a\"b"`},
		{name: "backslash", in: `a\b`, quoted: `"a\\b"`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			q := Quote(tc.in)
			if q != tc.quoted {
				t.Errorf("Quote(%q) = %s, want %s", tc.in, q, tc.quoted)
			}
			args, err := SplitRule("--comment " + q)
			if err != nil || len(args) != 2 || args[1] != tc.in {
				t.Errorf("SplitRule(Quote(%q)) = %q, %v", tc.in, args, err)
			}
		})
	}
	if got := Quote("a\nb"); got != `"a b"` {
		t.Errorf("Quote with newline = %s, want %q", got, `"a b"`)
	}
}

func TestJoinRule(t *testing.T) {
	args := []string{"-m", "comment", "--comment", "handle ClusterIPs; NOTE: first", "-m", "addrtype", "--dst-type", "LOCAL", "--comment", `a"b\c`, "--comment", "", "-j", "KUBE-X"}
	line := JoinRule(args)
	if want := `-m comment --comment "handle ClusterIPs; NOTE: first" -m addrtype --dst-type LOCAL --comment "a\"b\\c" --comment "" -j KUBE-X`; line != want {
		t.Errorf("JoinRule = %s, want %s", line, want)
	}
	got, err := SplitRule(line)
	if err != nil || !slices.Equal(got, args) {
		t.Errorf("SplitRule(JoinRule(args)) = %q, %v; want %q", got, err, args)
	}
}

func TestFailedLine(t *testing.T) {
	tests := []struct {
		name   string
		stderr string
		want   int
	}{
		{name: "nft parse error", stderr: "iptables-nft-restore v1.8.9 (nf_tables): unknown option \"--foo\"\nError occurred at line: 3\nTry `iptables-nft-restore -h'", want: 3},
		{name: "commit error", stderr: "iptables-nft-restore: line 12 failed: No chain/target/match by that name.", want: 12},
		{name: "legacy commit error", stderr: "iptables-restore: line 7 failed", want: 7},
		{name: "no line", stderr: "Another app is currently holding the xtables lock.", want: 0},
		{name: "word line without number", stderr: "bad line here; line 4 failed", want: 4},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := failedLine(tc.stderr); got != tc.want {
				t.Errorf("failedLine(%q) = %d, want %d", tc.stderr, got, tc.want)
			}
		})
	}
}

func TestLineOf(t *testing.T) {
	payload := []byte(":A - [0:0]\n-A A -j RETURN\n")
	tests := []struct {
		n    int
		want string
	}{{1, "*nat"}, {2, ":A - [0:0]"}, {3, "-A A -j RETURN"}, {4, "COMMIT"}}
	for _, tc := range tests {
		if got := lineOf(tc.n, "*nat\n", payload, "COMMIT\n"); got != tc.want {
			t.Errorf("lineOf(%d) = %q, want %q", tc.n, got, tc.want)
		}
	}
}

func TestCommandErrorMessage(t *testing.T) {
	inner := errors.New("exit status 2")
	e := &CommandError{Command: "iptables-nft-restore", Table: "nat", Stderr: "unknown option", Line: 3, LineText: "-A X --foo", Err: inner}
	msg := e.Error()
	for _, want := range []string{"iptables-nft-restore", "table nat", "unknown option", "line 3", "-A X --foo", "exit status 2"} {
		if !strings.Contains(msg, want) {
			t.Errorf("error %q lacks %q", msg, want)
		}
	}
	if !errors.Is(e, inner) {
		t.Errorf("errors.Is(CommandError, inner) = false")
	}
}

// splitRuleReference is SplitRule as it was before it returned substrings: a builder per
// argument, byte by byte. TestSplitRuleMatchesReference holds the two to the same answers.
func splitRuleReference(line string) ([]string, error) {
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
				return nil, errors.New("backslash at end of line")
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
		return nil, errors.New("unterminated quote")
	}
	if inArg {
		args = append(args, cur.String())
	}
	return args, nil
}

// TestSplitRuleMatchesReference: on lines made of the characters that matter (blanks, quotes,
// backslashes, letters), SplitRule answers as the byte-by-byte reference does.
func TestSplitRuleMatchesReference(t *testing.T) {
	const alphabet = ` "\a"b	`
	rng := rand.New(rand.NewPCG(1, 2))
	for range 200000 {
		b := make([]byte, rng.IntN(12))
		for i := range b {
			b[i] = alphabet[rng.IntN(len(alphabet))]
		}
		line := string(b)
		got, err := SplitRule(line)
		want, werr := splitRuleReference(line)
		if (err != nil) != (werr != nil) || !slices.Equal(got, want) || (err == nil && got == nil) {
			t.Fatalf("SplitRule(%q) = %q, %v; reference %q, %v", line, got, err, want, werr)
		}
	}
}

// TestSplitRuleAllocatesOnce: a rule without escapes costs one allocation, its slice.
func TestSplitRuleAllocatesOnce(t *testing.T) {
	line := `-A KUBE-PORTALS-CONTAINER -d 10.96.0.10/32 -p udp -m comment --comment "kube-system/kube-dns:dns" -m udp --dport 53 -j REDIRECT --to-ports 41537`
	if n := testing.AllocsPerRun(100, func() { _, _ = SplitRule(line) }); n != 1 {
		t.Errorf("SplitRule allocated %v times per call, want 1", n)
	}
}

func BenchmarkSplitRule(b *testing.B) {
	line := `-A KUBE-PORTALS-CONTAINER -d 10.96.0.10/32 -p udp -m comment --comment "kube-system/kube-dns:dns" -m udp --dport 53 -j REDIRECT --to-ports 41537`
	b.ReportAllocs()
	for b.Loop() {
		if _, err := SplitRule(line); err != nil {
			b.Fatal(err)
		}
	}
}
