package main

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"regexp"
	"strings"
	"testing"
)

var adminListeningRE = regexp.MustCompile(`msg="admin listening" addr=(\S+)`)

// TestRunAdminAddr: with -admin-addr and its token (here from the
// environment), the operators' API is served there, behind the token, and
// only there.
func TestRunAdminAddr(t *testing.T) {
	url, out, stop := start(t, []string{"-admin-addr", "127.0.0.1:0"}, map[string]string{"IDEM_ADMIN_TOKEN": "adm"})
	m := adminListeningRE.FindStringSubmatch(out.String())
	if m == nil {
		t.Fatalf("no admin listener in the log:\n%s", out)
	}
	adminURL := "http://" + m[1]
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}
	if resp, b := post(t, client, url, "sk_test_demo", "k-adm", `{"amount": 1, "currency": "usd", "customer": "c"}`); resp.StatusCode != http.StatusCreated {
		t.Fatalf("POST: %d %s", resp.StatusCode, b)
	}
	for _, tt := range []struct {
		url, token string
		want       int
		body       string
	}{
		{adminURL, "adm", 200, `"status":"completed"`},
		{adminURL, "", 401, ""},
		{adminURL, "sk_test_demo", 401, ""},
		{url, "adm", 404, ""},
	} {
		req, _ := http.NewRequest("GET", tt.url+"/admin/keys/demo/k-adm", nil)
		if tt.token != "" {
			req.Header.Set("Authorization", "Bearer "+tt.token)
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tt.want || !strings.Contains(string(b), tt.body) {
			t.Errorf("GET %s with token %q: %d %s, want %d with %q", tt.url, tt.token, resp.StatusCode, b, tt.want, tt.body)
		}
	}
	if err := stop(); err != nil {
		t.Fatalf("run: %v", err)
	}
}

// TestRunSweepAndAdminFlags: contradictory sweeper settings and an open
// admin API are refused, naming the flags.
func TestRunSweepAndAdminFlags(t *testing.T) {
	for _, tt := range []struct {
		name string
		args []string
		want string
	}{
		{"admin without a token", []string{"-admin-addr", "127.0.0.1:0"}, "-admin-addr needs -admin-token"},
		{"admin on the API's address", []string{"-addr", "127.0.0.1:8080", "-admin-addr", "127.0.0.1:8080", "-admin-token", "t"}, "its own"},
		{"grace below the processor timeout", []string{"-sweep-grace", "5s", "-processor-timeout", "10s"}, "-sweep-grace 5s is shorter than -processor-timeout 10s"},
		{"no sweep, paced", []string{"-no-sweep", "-sweep-interval", "1s"}, "-no-sweep"},
		{"negative grace", []string{"-sweep-grace", "-1s"}, "-sweep-grace -1s"},
		{"zero interval", []string{"-sweep-interval", "0s"}, "-sweep-interval 0s"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var out bytes.Buffer
			err := run(context.Background(), tt.args, func(string) string { return "" }, &out)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("run(%q) = %v, want an error with %q", tt.args, err, tt.want)
			}
		})
	}
}

// TestRunAdminAddrLoopbackByDefault: -admin-addr without a host listens on
// loopback only, and says so at start; a named host is listened on, and
// one that is not loopback is said at Warn.
func TestRunAdminAddrLoopbackByDefault(t *testing.T) {
	env := map[string]string{"IDEM_ADMIN_TOKEN": "adm"}
	_, out, stop := start(t, []string{"-admin-addr", ":0"}, env)
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	m := adminListeningRE.FindStringSubmatch(out.String())
	if m == nil || !strings.HasPrefix(m[1], "127.0.0.1:") || !strings.Contains(out.String(), "level=INFO msg=\"admin listening\"") {
		t.Errorf("log:\n%s\nwant the admin API on 127.0.0.1, at Info", out)
	}
	_, out, stop = start(t, []string{"-admin-addr", "0.0.0.0:0"}, env)
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if m := adminListeningRE.FindStringSubmatch(out.String()); m == nil || !strings.Contains(out.String(), "level=WARN msg=\"admin listening\"") {
		t.Errorf("log:\n%s\nwant the admin API on every interface, said at Warn", out)
	}
	for _, addr := range []string{"9090", "127.0.0.1"} {
		var buf bytes.Buffer
		if err := run(context.Background(), []string{"-admin-addr", addr, "-admin-token", "t"}, func(string) string { return "" }, &buf); err == nil ||
			!strings.Contains(err.Error(), "-admin-addr") {
			t.Errorf("-admin-addr %s: %v, want an error naming -admin-addr", addr, err)
		}
	}
}
