package main

import (
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"
)

// targetFlags are the -target flags as given.
type targetFlags struct {
	target, method, token, token2 string
	headers                       [2][]string // -header, -header2
	body, slowBody                string
	maxPayments, maxOps           int
	retention                     time.Duration
	wait, dryRun                  bool
	timeout                       time.Duration
}

// config checks the -target flags (set holds the names of those given)
// and returns the check's configuration.
func (f *targetFlags) config(set map[string]bool) (conformanceConfig, error) {
	u, err := url.Parse(f.target)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return conformanceConfig{}, fmt.Errorf("%w: -target must be an http or https URL, such as https://api.example.com/v1/payments", errUsage)
	}
	cfg := conformanceConfig{target: f.target, method: strings.ToUpper(f.method), maxOps: f.maxPayments,
		retention: f.retention, wait: f.wait, dryRun: f.dryRun, timeout: f.timeout}
	if set["max-operations"] {
		if set["max-payments"] && f.maxPayments != f.maxOps {
			return cfg, fmt.Errorf("%w: -max-payments %d and -max-operations %d disagree: they are one flag, give one", errUsage, f.maxPayments, f.maxOps)
		}
		cfg.maxOps = f.maxOps
	}
	for i, token := range []string{f.token, f.token2} {
		if cfg.creds[i], err = credentials(i+1, token, f.headers[i]); err != nil {
			return cfg, err
		}
	}
	switch {
	case cfg.method != http.MethodPost && cfg.method != http.MethodPatch:
		return cfg, fmt.Errorf("%w: -method must be POST or PATCH, the methods the contract keys", errUsage)
	case len(cfg.creds[0]) == 0:
		return cfg, fmt.Errorf("%w: -target needs the credentials of a client of the API: -token T (Authorization: Bearer T) or -header 'Name: value'", errUsage)
	case maps.EqualFunc(cfg.creds[0], cfg.creds[1], slices.Equal[[]string]):
		return cfg, fmt.Errorf("%w: -token2 and -header2 must be another client's credentials than -token and -header", errUsage)
	case cfg.maxOps < 1:
		return cfg, fmt.Errorf("%w: -max-operations (-max-payments) must be at least 1", errUsage)
	case f.retention < 0 || f.timeout <= 0:
		return cfg, fmt.Errorf("%w: -retention must not be negative, -timeout must be positive", errUsage)
	case f.wait && f.retention == 0:
		return cfg, fmt.Errorf("%w: -wait needs -retention, the retention to wait out", errUsage)
	}
	if cfg.body, err = checkBody("-body", f.body); err != nil {
		return cfg, err
	}
	if f.slowBody != "" {
		if cfg.slowBody, err = checkBody("-slow-body", f.slowBody); err != nil {
			return cfg, err
		}
	}
	return cfg, nil
}

// reservedHeaders are the headers -header may not set: the check sends
// the key itself, JSON bodies, and net/http frames the request.
var reservedHeaders = []string{keyHeaderName, "Content-Type", "Content-Length", "Transfer-Encoding", "Host", "Connection"}

// credentials returns the headers client n sends: Authorization: Bearer
// token if token is not empty, and each "Name: value" of headers.
func credentials(n int, token string, headers []string) (http.Header, error) {
	suffix := map[int]string{1: "", 2: "2"}[n]
	h := http.Header{}
	if token != "" {
		h.Set("Authorization", "Bearer "+token)
	}
	for _, line := range headers {
		name, value, ok := strings.Cut(line, ":")
		value = strings.Trim(value, " \t")
		if !ok || !validHeaderName(name) || !validHeaderValue(value) {
			return nil, fmt.Errorf("%w: -header%s %q must be one header, 'Name: value', such as 'X-Api-Key: K1'", errUsage, suffix, line)
		}
		for _, r := range reservedHeaders {
			if strings.EqualFold(name, r) {
				return nil, fmt.Errorf("%w: -header%s may not set %s: the check sets it", errUsage, suffix, r)
			}
		}
		if token != "" && strings.EqualFold(name, "Authorization") {
			return nil, fmt.Errorf("%w: -token%s and -header%s both set Authorization: give one", errUsage, suffix, suffix)
		}
		h.Add(name, value)
	}
	return h, nil
}

// validHeaderName reports whether s is a header name: an RFC 9110 token.
func validHeaderName(s string) bool {
	if s == "" {
		return false
	}
	for _, c := range []byte(s) {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0) {
			return false
		}
	}
	return true
}

// validHeaderValue reports whether s may be sent as a header value: no
// control characters but tab (no NUL, CR or LF).
func validHeaderValue(s string) bool {
	for _, c := range []byte(s) {
		if c < 0x20 && c != '\t' || c == 0x7f {
			return false
		}
	}
	return true
}
