package app

import (
	"fmt"

	"github.com/go-logr/logr"
	"github.com/rs/zerolog"
	"k8s.io/klog/v2"
)

// routeKlog sends what client-go logs through klog (watch failures, throttling, leader notes) to
// log, tagged component=client-go, so that the proxy's output has one format. klog's own
// verbosity still decides which of its V(n) messages are made at all (V(0) only, by default).
func routeKlog(log zerolog.Logger) {
	klog.SetLogger(logr.New(&zerologSink{log: log.With().Str("component", "client-go").Logger()}))
}

// zerologSink is a logr.LogSink writing to a zerolog.Logger: V(0) messages at info level, V(n>0)
// at debug, errors at error level.
type zerologSink struct {
	log zerolog.Logger
}

var _ logr.LogSink = (*zerologSink)(nil)

func (s *zerologSink) Init(logr.RuntimeInfo) {}

func (s *zerologSink) Enabled(level int) bool { return s.log.GetLevel() <= levelOf(level) }

func (s *zerologSink) Info(level int, msg string, kv ...any) {
	s.write(s.log.WithLevel(levelOf(level)), msg, kv)
}

func (s *zerologSink) Error(err error, msg string, kv ...any) {
	s.write(s.log.Error().Err(err), msg, kv)
}

func (s *zerologSink) WithValues(kv ...any) logr.LogSink {
	ctx := s.log.With()
	for i := 0; i+1 < len(kv); i += 2 {
		ctx = ctx.Interface(fmt.Sprint(kv[i]), kv[i+1])
	}
	return &zerologSink{log: ctx.Logger()}
}

func (s *zerologSink) WithName(name string) logr.LogSink {
	return &zerologSink{log: s.log.With().Str("logger", name).Logger()}
}

func (s *zerologSink) write(e *zerolog.Event, msg string, kv []any) {
	if e == nil {
		return
	}
	for i := 0; i+1 < len(kv); i += 2 {
		e = e.Interface(fmt.Sprint(kv[i]), kv[i+1])
	}
	e.Msg(msg)
}

func levelOf(v int) zerolog.Level {
	if v <= 0 {
		return zerolog.InfoLevel
	}
	return zerolog.DebugLevel
}
