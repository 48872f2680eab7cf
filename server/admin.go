package server

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/idemkit/idem/server/idempotency"
)

// Admin returns what an operator does with the server's keys (see
// [idempotency.Admin]): its actions are logged on the server's logger and
// counted on /metrics.
func (s *Server) Admin() *idempotency.Admin {
	return &idempotency.Admin{Store: s.cfg.Storage.Keys, Logger: s.log, OnEvent: s.metrics.Observe}
}

// AdminHandler returns the operators' JSON API on the server's keys, for a
// listener of its own (idem-server's -admin-addr), behind a bearer token of
// its own: every request needs Authorization: Bearer <token>, or gets 401.
//
//	GET  /admin/keys/{client}/{key}          one key; ?body=1 adds the stored response's body
//	GET  /admin/keys?stuck=30s               started keys whose operation began at least 30s ago
//	GET  /admin/keys?released=1              released keys, awaiting a retry (?released=5m: released at least 5m ago)
//	                                         (both take &client=<id> and &limit=<n>, at most 1000)
//	GET  /admin/stats                        counts of the keys that are not finished
//	POST /admin/keys/{client}/{key}/release  release a started key, as failed: {"reason": "...", "running": false}
//	POST /admin/keys/{client}/{key}/expire   expire a key at once: {"reason": "...", "running": false}
//
// The reason is required; it is logged with the key and the action is
// counted on /metrics. A key whose request is running is released or
// expired only with "running": true, which fences its request. An expired
// key counts as absent at once: a new request claims it; the purge keeps
// it until its retention has passed since its operation began, so that a
// retry of that operation is refused (410) however late it comes. A client id
// or key holding a slash is sent percent-encoded (%2F). Answers are JSON;
// errors are problem details (404 for an unknown key, 409 for a running or
// completed one). It returns an error for an empty token, or a key store
// that does not implement [idempotency.Inspector].
func (s *Server) AdminHandler(token string) (http.Handler, error) {
	if token == "" {
		return nil, errors.New("server: the admin API needs a token")
	}
	if _, ok := s.cfg.Storage.Keys.(idempotency.Inspector); !ok {
		return nil, fmt.Errorf("server: the key store (%T) does not implement idempotency.Inspector", s.cfg.Storage.Keys)
	}
	a := &admin{keys: s.Admin()}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /admin/keys/{client}/{key}", a.lookup)
	mux.HandleFunc("GET /admin/keys", a.list)
	mux.HandleFunc("GET /admin/stats", a.stats)
	mux.HandleFunc("POST /admin/keys/{client}/{key}/release", a.act(a.keys.ForceRelease, "released"))
	mux.HandleFunc("POST /admin/keys/{client}/{key}/expire", a.act(a.keys.Expire, "expired"))
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeProblem(w, r, ProblemNotFound, http.StatusNotFound, "No such admin resource; see server.Server.AdminHandler.")
	})
	want := []byte("Bearer " + token)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if subtle.ConstantTimeCompare([]byte(r.Header.Get("Authorization")), want) != 1 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="idem-admin"`)
			writeProblem(w, r, idempotency.ProblemUnauthorized, http.StatusUnauthorized, "Send the admin token: Authorization: Bearer <token>.")
			return
		}
		mux.ServeHTTP(w, r)
	}), nil
}

// admin serves AdminHandler.
type admin struct{ keys *idempotency.Admin }

// keyView is the JSON form of an idempotency.KeyInfo.
type keyView struct {
	ClientID    string        `json:"client_id"`
	Key         string        `json:"key"`
	Method      string        `json:"method"`
	Path        string        `json:"path"`
	Status      string        `json:"status"`
	ReleaseKind string        `json:"release_kind,omitempty"`
	OperationID string        `json:"operation_id"`
	Token       int64         `json:"token"`
	CreatedAt   time.Time     `json:"created_at"`
	LockedAt    time.Time     `json:"locked_at"`
	FinishedAt  *time.Time    `json:"finished_at,omitempty"`
	ExpiresAt   *time.Time    `json:"expires_at,omitempty"`
	Lease       string        `json:"lease"`
	Retention   string        `json:"retention"`
	LeaseAge    string        `json:"lease_age"`
	Running     bool          `json:"running"`
	Lapsed      bool          `json:"lapsed"`
	Expired     bool          `json:"expired"`
	Response    *responseView `json:"response,omitempty"`
}

// responseView is the JSON form of a stored response: its body as text
// when it is valid UTF-8, else in base64; neither unless asked for.
type responseView struct {
	Status      int               `json:"status"`
	ContentType string            `json:"content_type,omitempty"`
	Header      map[string]string `json:"header,omitempty"`
	Body        *string           `json:"body,omitempty"`
	BodyBase64  []byte            `json:"body_base64,omitempty"`
}

func viewOf(k idempotency.KeyInfo) keyView {
	v := keyView{
		ClientID: k.ClientID, Key: k.Key, Method: k.Method, Path: k.Path, Status: string(k.Status),
		OperationID: k.OperationID, Token: k.Token,
		CreatedAt: k.CreatedAt.UTC(), LockedAt: k.LockedAt.UTC(),
		Lease: k.Lease.String(), Retention: k.Retention.String(), LeaseAge: k.LeaseAge.Round(time.Millisecond).String(),
		Running: k.Running(), Lapsed: k.Lapsed, Expired: k.Expired,
	}
	if k.Status == idempotency.StatusReleased {
		v.ReleaseKind = k.ReleaseKind.String()
	}
	if !k.FinishedAt.IsZero() {
		t := k.FinishedAt.UTC()
		v.FinishedAt = &t
	}
	if !k.ExpiresAt.IsZero() {
		t := k.ExpiresAt.UTC()
		v.ExpiresAt = &t
	}
	if r := k.Response; r != nil {
		v.Response = &responseView{Status: r.Status, ContentType: r.ContentType, Header: r.Header}
		switch {
		case r.Body == nil:
		case utf8.Valid(r.Body):
			body := string(r.Body)
			v.Response.Body = &body
		default:
			v.Response.BodyBase64 = r.Body
		}
	}
	return v
}

func (a *admin) lookup(w http.ResponseWriter, r *http.Request) {
	k, err := a.keys.Lookup(r.Context(), r.PathValue("client"), r.PathValue("key"), r.URL.Query().Get("body") == "1")
	if err != nil {
		a.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, viewOf(k))
}

func (a *admin) list(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	f := idempotency.ListFilter{ClientID: q.Get("client")}
	stuck, released := q.Get("stuck"), q.Get("released")
	var age string
	switch {
	case stuck != "" && released == "":
		f.Status, age = idempotency.StatusStarted, stuck
	case released != "" && stuck == "":
		f.Status, age = idempotency.StatusReleased, released
		if released == "1" {
			age = "0s"
		}
	default:
		writeProblem(w, r, idempotency.ProblemInvalidRequest, http.StatusBadRequest,
			"Say which keys: ?stuck=30s (started keys whose operation began at least 30s ago) or ?released=1 (released keys).")
		return
	}
	d, err := time.ParseDuration(age)
	if err != nil || d < 0 {
		writeProblem(w, r, idempotency.ProblemInvalidRequest, http.StatusBadRequest,
			fmt.Sprintf("%q is not a duration such as 30s or 5m.", age))
		return
	}
	f.OlderThan = d
	if l := q.Get("limit"); l != "" {
		if f.Limit, err = strconv.Atoi(l); err != nil || f.Limit < 1 {
			writeProblem(w, r, idempotency.ProblemInvalidRequest, http.StatusBadRequest,
				fmt.Sprintf("limit %q is not a positive number (at most %d).", l, idempotency.MaxListLimit))
			return
		}
	}
	ks, err := a.keys.List(r.Context(), f)
	if err != nil {
		a.fail(w, r, err)
		return
	}
	views := make([]keyView, len(ks))
	for i, k := range ks {
		views[i] = viewOf(k)
	}
	writeJSON(w, http.StatusOK, struct {
		Keys []keyView `json:"keys"`
	}{views})
}

func (a *admin) stats(w http.ResponseWriter, r *http.Request) {
	st, err := a.keys.Stats(r.Context())
	if err != nil {
		a.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, struct {
		Running              int64   `json:"running"`
		OldestRunningSeconds float64 `json:"oldest_running_seconds"`
		Lapsed               int64   `json:"lapsed"`
		ReleasedFailed       int64   `json:"released_failed"`
	}{st.Running, st.OldestRunning.Seconds(), st.Lapsed, st.ReleasedFailed})
}

// act serves POST .../release and .../expire with do.
func (a *admin) act(do func(ctx context.Context, clientID, key, reason string, running bool) (idempotency.KeyInfo, error), done string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var in struct {
			Reason  string `json:"reason"`
			Running bool   `json:"running"`
		}
		dec := json.NewDecoder(io.LimitReader(r.Body, 1<<16))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&in); err != nil || strings.TrimSpace(in.Reason) == "" {
			writeProblem(w, r, idempotency.ProblemInvalidRequest, http.StatusBadRequest,
				`Send {"reason": "why, for the log", "running": false}; a reason is required, and "running": true acts on a key whose request runs.`)
			return
		}
		was, err := do(r.Context(), r.PathValue("client"), r.PathValue("key"), in.Reason, in.Running)
		if err != nil {
			a.fail(w, r, err)
			return
		}
		writeJSON(w, http.StatusOK, struct {
			Done string  `json:"done"`
			Was  keyView `json:"was"`
		}{done, viewOf(was)})
	}
}

// fail answers the error of an admin action.
func (a *admin) fail(w http.ResponseWriter, r *http.Request, err error) {
	switch {
	case errors.Is(err, idempotency.ErrKeyNotFound):
		writeProblem(w, r, ProblemNotFound, http.StatusNotFound, "No such key: never stored, purged, or expired.")
	case errors.Is(err, idempotency.ErrKeyRunning):
		writeProblem(w, r, idempotency.ProblemKeyInUse, http.StatusConflict,
			`The key's request is running. Send "running": true to act anyway: its request is fenced, and its writes rolled back.`)
	case errors.Is(err, idempotency.ErrKeyCompleted):
		writeProblem(w, r, idempotency.ProblemKeyInUse, http.StatusConflict,
			"The key is completed: releasing it would run its operation again. Expire it if it must go.")
	default:
		a.keys.Logger.Error("admin: a request on the keys failed", "path", r.URL.Path, "err", err)
		writeProblem(w, r, idempotency.ProblemInternal, http.StatusInternalServerError, "The keys could not be read or changed. Retry.")
	}
}
