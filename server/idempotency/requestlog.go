package idempotency

import (
	"context"
	"log/slog"
)

// requestLog is the logger of one keyed request: [Options.Logger] with
// the request's client, key, method and path on every record. Unlike
// Logger.With, which has the handler format them for every request (a text
// or JSON handler writes them out at once), it adds them to the records
// that are logged, and most requests log none. The logger and its handler
// are one allocation.
type requestLog struct {
	log slog.Logger
	h   requestHandler
}

// requestHandler adds a request's attributes to the records of its
// logger, before their own, where Logger.With would have put them.
type requestHandler struct {
	base                        slog.Handler
	clientID, key, method, path string
}

// newRequestLog returns the logger of a keyed request on base.
func newRequestLog(base *slog.Logger, clientID, key, method, path string) *slog.Logger {
	l := &requestLog{h: requestHandler{base: base.Handler(), clientID: clientID, key: key, method: method, path: path}}
	l.log = *slog.New(&l.h)
	return &l.log
}

func (h *requestHandler) attrs() []slog.Attr {
	return []slog.Attr{slog.String("client", h.clientID), slog.String("key", h.key),
		slog.String("method", h.method), slog.String("path", h.path)}
}

func (h *requestHandler) Enabled(ctx context.Context, level slog.Level) bool {
	return h.base.Enabled(ctx, level)
}

func (h *requestHandler) Handle(ctx context.Context, r slog.Record) error {
	out := slog.NewRecord(r.Time, r.Level, r.Message, r.PC)
	out.AddAttrs(h.attrs()...)
	r.Attrs(func(a slog.Attr) bool {
		out.AddAttrs(a)
		return true
	})
	return h.base.Handle(ctx, out)
}

func (h *requestHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	return h.base.WithAttrs(h.attrs()).WithAttrs(attrs)
}

func (h *requestHandler) WithGroup(name string) slog.Handler {
	return h.base.WithAttrs(h.attrs()).WithGroup(name)
}
