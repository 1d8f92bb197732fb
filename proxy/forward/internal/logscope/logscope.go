// Package logscope starts the log events of the data path's proxies: at a level of a Logger that
// may be nil (Logger), with the fields of the proxy's scope added at log time (Event; see
// forward.LogScope), and the warning of a transparent dial that fell back to the node's address.
package logscope

import "github.com/rs/zerolog"

// Scope adds the fields naming what a proxy serves to an event: forward.LogScope's method set.
type Scope interface {
	ScopeEvent(e *zerolog.Event) *zerolog.Event
}

// Event returns e with s's fields; a nil e (the level is off) stays nil, and costs nothing.
func Event(s Scope, e *zerolog.Event) *zerolog.Event {
	if s == nil || e == nil {
		return e
	}
	return s.ScopeEvent(e)
}

// nopLog discards everything.
var nopLog = zerolog.Nop()

// Logger returns l, or a Logger that discards everything when l is nil.
func Logger(l *zerolog.Logger) *zerolog.Logger {
	if l == nil {
		return &nopLog
	}
	return l
}
