package idem

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
)

// defaultHTTPClient serves Clients whose HTTPClient is nil. Its Transport's
// retry budget is shared by all of them.
var defaultHTTPClient = &http.Client{Transport: new(Transport)}

// Client is a small client for JSON APIs such as a payments API, built on
// [Transport]: it sends JSON, decodes JSON answers, authenticates with a
// bearer token and turns error answers into [*APIError]. Every POST and
// PATCH it sends is keyed and retried by the Transport.
//
// The zero value needs only BaseURL. A Client is safe for concurrent use.
type Client struct {
	// BaseURL is prepended to every path, such as "https://api.example.com".
	BaseURL string
	// Token, if not empty, is sent as "Authorization: Bearer <Token>".
	Token string
	// HTTPClient sends the requests. If nil, a shared client whose
	// Transport is a zero [Transport] is used. Give it an http.Client whose
	// Transport is a *Transport (or wraps one) to keep the retry behaviour.
	HTTPClient *http.Client
}

// Post sends in as JSON to path and decodes the answer into out (if not
// nil). Pin the operation's key with [WithKey] on ctx to retry it across
// calls; otherwise each call is a new operation with a new key, which the
// error names if the call fails.
func (c *Client) Post(ctx context.Context, path string, in, out any) (*http.Response, error) {
	return c.Do(ctx, http.MethodPost, path, in, out)
}

// Get fetches path and decodes the answer into out (if not nil).
func (c *Client) Get(ctx context.Context, path string, out any) (*http.Response, error) {
	return c.Do(ctx, http.MethodGet, path, nil, out)
}

// Do sends a request with in (if not nil) as its JSON body and decodes a
// 2xx answer's JSON body into out (if not nil). It returns the response
// with its body already read and closed, for its status and headers (see
// [Replayed]). A non-2xx answer is returned as an [*APIError], with the
// start of its body (64 KiB, read for one second at most); the
// Transport's own errors ([*KeyReuseError], [*InProgressError],
// [*KeyExpiredError], [*AnswerLostError], [*RetryError]) come back inside
// a *url.Error, reachable with errors.As. A 2xx answer to a keyed request
// whose body cannot be read or decoded into out is an [*AnswerLostError]
// (the operation took effect; ask again with its key), returned with the
// response.
//
// A POST or PATCH whose ctx pins no key ([WithKey]) gets a new key
// ([NewKey]) pinned for the call: every attempt and every redirect of the
// call sends it, and every error of the call names it (APIError.Key, and
// the message of any other error, even http.Client.Timeout's and that of a
// 2xx answer whose body cannot be decoded), so that a failed call can be
// retried with the same key. A Transport with [Transport.KeyBodyField]
// sends the key already in that field of in, if any: the errors then name
// that one, the key the server saw.
func (c *Client) Do(ctx context.Context, method, path string, in, out any) (*http.Response, error) {
	var ck *clientKey
	if method == http.MethodPost || method == http.MethodPatch {
		key, pinned := KeyFromContext(ctx)
		if !pinned {
			key = NewKey()
		}
		// Pinned again, so that the Transport says which key it sent: a
		// key already in the body (KeyBodyField) wins over this one.
		ctx, ck = withClientKey(ctx, key, !pinned)
	}
	var body io.Reader
	if in != nil {
		data, err := json.Marshal(in)
		if err != nil {
			return nil, refused(fmt.Errorf("idem: encoding request body: %w", err))
		}
		body = bytes.NewReader(data)
	}
	url := strings.TrimSuffix(c.BaseURL, "/") + "/" + strings.TrimPrefix(path, "/")
	req, err := http.NewRequestWithContext(ctx, method, url, body)
	if err != nil {
		return nil, refused(fmt.Errorf("idem: %w", err))
	}
	req.Header.Set("Accept", "application/json")
	if in != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if c.Token != "" {
		req.Header.Set("Authorization", "Bearer "+c.Token)
	}
	hc := c.HTTPClient
	if hc == nil {
		hc = defaultHTTPClient
	}
	resp, err := hc.Do(req)
	var key string // the key sent
	if ck != nil {
		key = ck.sentKey()
	}
	if err != nil {
		return nil, withKey(method, req, key, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		// Bounded as the Transport bounds problem details: a caller whose
		// context has no deadline is not held by a body that stalls.
		problem, raw := readProblem(resp, maxDrainTime)
		apiErr := &APIError{StatusCode: resp.StatusCode, Method: method, URL: redact(req), Key: key, Body: raw, afterReached: afterReached(resp)}
		if isJSON(resp.Header.Get("Content-Type")) {
			apiErr.Problem = problem
		}
		return resp, apiErr
	}
	if out != nil && resp.StatusCode != http.StatusNoContent {
		if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
			// The operation is done: its key fetches the answer again.
			err = fmt.Errorf("decoding the %s answer: %w", resp.Status, err)
			if key == "" {
				return resp, fmt.Errorf("idem: %s %s: %w", method, redact(req), err)
			}
			return resp, &AnswerLostError{Key: key, Method: method, URL: redact(req), StatusCode: resp.StatusCode, Attempts: attemptNumber(resp), Err: err}
		}
	}
	readBody(io.Discard, resp, maxDrain, maxDrainTime) // what follows the JSON, for the connection's sake
	return resp, nil
}

// withKey returns err with the request and its key in front, for a keyed
// request; else err as it is. The request and the key are said once: an
// error of idem's that names them already is said as it is, and
// http.Client's *url.Error prefix ("Post \"URL\": ") is left out of the
// message, though not out of the chain.
func withKey(method string, req *http.Request, key string, err error) error {
	if key == "" {
		return err
	}
	var named interface{ namesRequest() }
	if errors.As(err, &named) {
		return &requestError{msg: named.(error).Error(), err: err}
	}
	text := err.Error()
	if ue := (*url.Error)(nil); errors.As(err, &ue) {
		text = ue.Err.Error()
	}
	return &requestError{
		msg: fmt.Sprintf("idem: %s %s with idempotency key %s: %s", method, redact(req), key, strings.TrimPrefix(text, "idem: ")),
		err: err,
	}
}

// requestError is an error of a Client call: its message says the request
// and its key once, its chain holds what http.Client returned.
type requestError struct {
	msg string
	err error
}

func (e *requestError) Error() string { return e.msg }
func (e *requestError) Unwrap() error { return e.err }
