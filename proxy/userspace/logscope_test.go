package userspace

import (
	"bytes"
	"testing"

	"github.com/rs/zerolog"
	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// TestListenerLogScope: a listener's events, whose servicePort field is added at log time, read
// as those of a logger scoped with With, byte for byte; a level that is off costs no event.
func TestListenerLogScope(t *testing.T) {
	var got, want bytes.Buffer
	base := zerolog.New(&got).Level(zerolog.InfoLevel).With().Str("component", "proxier").Logger()
	sp := &proxy.ServicePort{Name: proxy.Name{Namespace: "ns", Name: "web", Port: "http"}, Protocol: v1.ProtocolTCP}
	l := &listener{log: &base}
	l.choose.sp.Store(sp)
	scoped := zerolog.New(&want).Level(zerolog.InfoLevel).With().Str("component", "proxier").Logger().
		With().Str("servicePort", sp.String()).Logger()

	l.logInfo().Int("proxyPort", 40001).Msg("opened")
	scoped.Info().Int("proxyPort", 40001).Msg("opened")
	l.logError().Err(errTest).Msg("failed")
	scoped.Error().Err(errTest).Msg("failed")
	if got.String() != want.String() {
		t.Errorf("listener events:\n%s\nwant:\n%s", got.String(), want.String())
	}
	if e := l.logDebug(); e != nil {
		t.Errorf("debug event %v with the level at info, want none", e)
	}
}

var errTest = testError("refused")

type testError string

func (e testError) Error() string { return string(e) }
