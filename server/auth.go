package server

import (
	"crypto/subtle"
	"fmt"
	"net/http"
	"strings"

	"github.com/idemkit/idem/server/idempotency"
	"time"
)

// ParseAPIKeys parses the -api-keys flag: comma-separated token:client_id
// pairs, such as "sk_test_demo:demo,sk_test_other:other". It returns the
// tokens mapped to their client ids, and an error for an empty token or
// client id, a pair without a colon, or a token listed twice.
func ParseAPIKeys(s string) (map[string]string, error) {
	keys := make(map[string]string)
	for pair := range strings.SplitSeq(s, ",") {
		pair = strings.TrimSpace(pair)
		if pair == "" {
			continue
		}
		token, client, ok := strings.Cut(pair, ":")
		token, client = strings.TrimSpace(token), strings.TrimSpace(client)
		if !ok || token == "" || client == "" {
			return nil, fmt.Errorf("server: API key %q is not token:client_id", redact(pair))
		}
		if _, dup := keys[token]; dup {
			return nil, fmt.Errorf("server: API key %q is listed twice", redact(token))
		}
		keys[token] = client
	}
	if len(keys) == 0 {
		return nil, fmt.Errorf("server: no API keys in %q", s)
	}
	return keys, nil
}

// redact keeps the start of a secret for error messages.
func redact(s string) string {
	if len(s) <= 8 {
		return "…"
	}
	return s[:8] + "…"
}

// BearerAuth returns middleware that authenticates requests with an
// Authorization: Bearer <token> header, tokens mapping to client ids, and
// stores the client id in the request context ([idempotency.WithClientID]),
// where the middleware's default [idempotency.Options.ClientID] finds it. A
// request without a known token, or with more than one Authorization line
// (ambiguous credentials), gets 401 [idempotency.ProblemUnauthorized] with
// a WWW-Authenticate challenge.
//
// The 401 is written without reading the request body, and the connection
// is closed after it (Connection: close, and no more is read from it): an
// unauthenticated client cannot make the server wait for, or read, a body
// it announced. The tokens map must not change afterwards; the middleware
// is safe for concurrent use.
func BearerAuth(tokens map[string]string) func(http.Handler) http.Handler {
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			lines := r.Header.Values("Authorization")
			client, ok := "", false
			if len(lines) == 1 {
				client, ok = lookupToken(tokens, lines[0])
			}
			if !ok {
				// Without Connection: close, net/http reads up to 256 KiB
				// of the unread body before it writes the response, to
				// reuse the connection; and after it, it reads the rest
				// again unless the read deadline has passed.
				w.Header().Set("Connection", "close")
				http.NewResponseController(w).SetReadDeadline(time.Now()) // not supported by a recorder: nothing to stop there
				w.Header().Set("WWW-Authenticate", `Bearer realm="idem"`)
				detail := "Send a valid API key as Authorization: Bearer <token>."
				if len(lines) > 1 {
					detail = "Send one Authorization header: this request has several, which is ambiguous."
				}
				writeProblem(w, r, idempotency.ProblemUnauthorized, http.StatusUnauthorized, detail)
				return
			}
			next.ServeHTTP(w, r.WithContext(idempotency.WithClientID(r.Context(), client)))
		})
	}
}

// lookupToken finds the client of an Authorization header value, comparing
// tokens in constant time.
func lookupToken(tokens map[string]string, header string) (string, bool) {
	scheme, token, ok := strings.Cut(strings.TrimSpace(header), " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return "", false
	}
	token = strings.TrimSpace(token)
	found, client := 0, ""
	for t, c := range tokens {
		if subtle.ConstantTimeCompare([]byte(t), []byte(token)) == 1 {
			found, client = 1, c
		}
	}
	return client, found == 1 && token != ""
}
