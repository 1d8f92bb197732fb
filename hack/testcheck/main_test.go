package main

import (
	"bytes"
	"strings"
	"testing"
)

func TestRun(t *testing.T) {
	const (
		pass = `{"Action":"run","Package":"m/a","Test":"TestA"}
{"Action":"output","Package":"m/a","Test":"TestA","Output":"=== RUN   TestA\n"}
{"Action":"output","Package":"m/a","Test":"TestA","Output":"--- PASS: TestA (0.00s)\n"}
{"Action":"pass","Package":"m/a","Test":"TestA"}
{"Action":"output","Package":"m/a","Output":"PASS\n"}
{"Action":"output","Package":"m/a","Output":"ok  \tm/a\t0.01s\n"}
{"Action":"pass","Package":"m/a"}
`
		skip = `{"Action":"run","Package":"m/b","Test":"TestB"}
{"Action":"output","Package":"m/b","Test":"TestB","Output":"=== RUN   TestB\n"}
{"Action":"output","Package":"m/b","Test":"TestB","Output":"--- SKIP: TestB (0.00s)\n"}
{"Action":"output","Package":"m/b","Test":"TestB","Output":"    b_test.go:9: needs root\n"}
{"Action":"skip","Package":"m/b","Test":"TestB"}
{"Action":"output","Package":"m/b","Output":"ok  \tm/b\t0.01s\n"}
{"Action":"pass","Package":"m/b"}
`
		fail = `{"Action":"run","Package":"m/c","Test":"TestC"}
{"Action":"output","Package":"m/c","Test":"TestC","Output":"    c_test.go:3: broken\n"}
{"Action":"fail","Package":"m/c","Test":"TestC"}
{"Action":"output","Package":"m/c","Output":"FAIL\tm/c\t0.01s\n"}
{"Action":"fail","Package":"m/c"}
`
		mainSkip = `{"Action":"output","Package":"m/d","Output":"SKIP: every test of this package: root\n"}
{"Action":"output","Package":"m/d","Output":"ok  \tm/d\t0.01s\n"}
{"Action":"pass","Package":"m/d"}
`
		noFiles = `{"Action":"output","Package":"m/e","Output":"?   \tm/e\t[no test files]\n"}
{"Action":"skip","Package":"m/e"}
`
	)
	for _, tc := range []struct {
		name, in string
		code     int
		want     []string // in the output
	}{
		{name: "all pass", in: pass + noFiles, code: 0, want: []string{"ok  \tm/a", "?   \tm/e"}},
		{name: "a skipped test fails the run", in: pass + skip, code: 1, want: []string{"1 skipped", "m/b TestB: b_test.go:9: needs root"}},
		{name: "a failed test fails the run", in: pass + fail, code: 1, want: []string{"broken", "m/c TestC"}},
		{name: "a package skipped in TestMain fails the run", in: mainSkip, code: 1, want: []string{"m/d: every test of this package: root"}},
		{name: "nothing reported", in: "go: no packages\n", code: 1, want: []string{"go: no packages", "no package reported"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			if code := run(strings.NewReader(tc.in), &out); code != tc.code {
				t.Errorf("exit code %d, want %d; output:\n%s", code, tc.code, out.String())
			}
			for _, w := range tc.want {
				if !strings.Contains(out.String(), w) {
					t.Errorf("output lacks %q:\n%s", w, out.String())
				}
			}
		})
	}
}
