package app

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/rs/zerolog"
)

// fakeRouting records the calls enableTransparent makes.
type fakeRouting struct {
	enableErr, cleanupErr error
	enabled, cleaned      int
}

func (f *fakeRouting) EnableTransparent(context.Context) error {
	f.enabled++
	return f.enableErr
}

func (f *fakeRouting) CleanupTransparent(context.Context) error {
	f.cleaned++
	return f.cleanupErr
}

func TestEnableTransparent(t *testing.T) {
	for _, tc := range []struct {
		name        string
		routing     fakeRouting
		want        bool
		wantCleaned int
		wantLog     []string
	}{
		{name: "enabled", want: true},
		{
			name:        "the kernel refuses: serve without, remove the partial routing",
			routing:     fakeRouting{enableErr: errors.New("mangle: no xt_socket")},
			wantCleaned: 1,
			wantLog:     []string{"transparent connections disabled", "no xt_socket"},
		},
		{
			name:        "the cleanup fails too: both logged",
			routing:     fakeRouting{enableErr: errors.New("no xt_socket"), cleanupErr: errors.New("ip rule busy")},
			wantCleaned: 1,
			wantLog:     []string{"transparent connections disabled", "removing the partly programmed routing", "ip rule busy"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var buf bytes.Buffer
			r := tc.routing
			got := enableTransparent(context.Background(), &r, zerolog.New(&buf))
			if got != tc.want || r.enabled != 1 || r.cleaned != tc.wantCleaned {
				t.Errorf("enableTransparent = %v (enable called %d, cleanup %d), want %v (1, %d)", got, r.enabled, r.cleaned, tc.want, tc.wantCleaned)
			}
			for _, s := range tc.wantLog {
				if !strings.Contains(buf.String(), s) {
					t.Errorf("log lacks %q:\n%s", s, buf.String())
				}
			}
			if tc.want && buf.Len() != 0 {
				t.Errorf("logged on success:\n%s", buf.String())
			}
		})
	}
}
