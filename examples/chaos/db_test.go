package main

import (
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

func TestWithParams(t *testing.T) {
	params := [][2]string{{"search_path", "s"}, {"application_name", "a"}}
	tests := []struct{ in, want string }{
		{"postgres://u@h:1/db?sslmode=disable", "postgres://u@h:1/db?application_name=a&search_path=s&sslmode=disable"},
		{"postgresql://u@h/db", "postgresql://u@h/db?application_name=a&search_path=s"},
		{"host=/tmp/x port=5 user=u ", "host=/tmp/x port=5 user=u search_path=s application_name=a"},
	}
	for _, tt := range tests {
		if got := withParams(tt.in, params); got != tt.want {
			t.Errorf("withParams(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

func TestRedactURL(t *testing.T) {
	tests := []struct{ in, want string }{
		{"postgres://u:secret@h/db", "postgres://u:xxxxx@h/db"},
		{"postgres://u@h/db", "postgres://u@h/db"},
		{"host=h password=secret", "(a connection string with a password)"},
	}
	for _, tt := range tests {
		if got := redactURL(tt.in); got != tt.want {
			t.Errorf("redactURL(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

func TestSchedule(t *testing.T) {
	d := 30 * time.Second
	a := schedule(rand.New(rand.NewPCG(1, streamKills)), 6, d)
	b := schedule(rand.New(rand.NewPCG(1, streamKills)), 6, d)
	if !slices.Equal(a, b) {
		t.Errorf("one seed gave %v and %v", a, b)
	}
	if !slices.IsSorted(a) || a[0] < d/10 || a[len(a)-1] > d*9/10 {
		t.Errorf("schedule %v: want sorted times within [%s, %s]", a, d/10, d*9/10)
	}
}

func TestPercentile(t *testing.T) {
	var ds []time.Duration
	for i := 1; i <= 100; i++ {
		ds = append(ds, time.Duration(i)*time.Millisecond)
	}
	for _, tt := range []struct {
		q    float64
		want time.Duration
	}{{0.5, 50 * time.Millisecond}, {0.99, 99 * time.Millisecond}, {1, 100 * time.Millisecond}, {0, time.Millisecond}} {
		if got := percentile(ds, tt.q); got != tt.want {
			t.Errorf("percentile(%v) = %s, want %s", tt.q, got, tt.want)
		}
	}
	if got := percentile(nil, 0.5); got != 0 {
		t.Errorf("percentile of nothing = %s, want 0", got)
	}
}
