package logscope

import (
	"bytes"
	"errors"
	"net/netip"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/rs/zerolog"
)

type portScope string

func (s portScope) ScopeEvent(e *zerolog.Event) *zerolog.Event { return e.Str("port", string(s)) }

// TestEvent: the scope's fields are added to an event, and a nil scope or event is passed through.
func TestEvent(t *testing.T) {
	var buf bytes.Buffer
	l := zerolog.New(&buf)
	Event(portScope("default/echo:tcp"), l.Info()).Msg("hello")
	if !strings.Contains(buf.String(), `"port":"default/echo:tcp"`) {
		t.Errorf("scoped event %s lacks the scope's field", buf.String())
	}
	buf.Reset()
	Event(nil, l.Info()).Msg("plain")
	if strings.Contains(buf.String(), "port") || !strings.Contains(buf.String(), "plain") {
		t.Errorf("unscoped event %s", buf.String())
	}
	if Event(portScope("x"), nil) != nil {
		t.Error("a disabled (nil) event came back non-nil")
	}
}

// TestLoggerNil: a nil Logger discards.
func TestLoggerNil(t *testing.T) {
	if Logger(nil).GetLevel() != zerolog.Disabled {
		t.Error("Logger(nil) does not discard")
	}
	l := zerolog.New(nil)
	if Logger(&l) != &l {
		t.Error("Logger(l) is not l")
	}
}

// TestTransparentFallback: the first fallback of a proxy is a warning, later ones debug lines.
func TestTransparentFallback(t *testing.T) {
	var buf bytes.Buffer
	l := zerolog.New(&buf)
	var warned atomic.Bool
	client, ep := netip.MustParseAddrPort("10.0.0.1:4000"), netip.MustParseAddrPort("10.1.0.1:80")
	TransparentFallback(&l, portScope("p"), &warned, errors.New("EPERM"), client, ep)
	TransparentFallback(&l, portScope("p"), &warned, errors.New("EPERM"), client, ep)
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 2 || !strings.Contains(lines[0], `"level":"warn"`) || !strings.Contains(lines[1], `"level":"debug"`) ||
		!strings.Contains(lines[0], `"port":"p"`) {
		t.Errorf("log lines %q, want a scoped warning then a debug line", lines)
	}
}
