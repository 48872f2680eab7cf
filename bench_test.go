package idem

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"testing"
)

// benchBody is a small JSON payment request.
var benchBody = []byte(`{"amount":4200,"currency":"usd","customer":"cus_123"}`)

// benchCreated is the answer of benchBase.
var benchCreated = []byte(`{"id":"pay_123"}`)

// benchBase answers 201 in memory after reading the request body, so that
// what a benchmark measures is the Transport's own cost.
func benchBase(req *http.Request) (*http.Response, error) {
	if req.Body != nil {
		_, _ = io.Copy(io.Discard, req.Body)
		req.Body.Close()
	}
	return &http.Response{
		Status:        "201 Created",
		StatusCode:    http.StatusCreated,
		Header:        http.Header{},
		Body:          io.NopCloser(bytes.NewReader(benchCreated)),
		ContentLength: int64(len(benchCreated)),
		Request:       req,
	}, nil
}

// benchRoundTrip sends keyed POSTs built from a bytes.Reader (which has
// GetBody) through tr, each answered 201 at the first attempt.
func benchRoundTrip(b *testing.B, tr *Transport) {
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, "https://api.example.com/v1/payments", bytes.NewReader(benchBody))
		if err != nil {
			b.Fatal(err)
		}
		resp, err := tr.RoundTrip(req)
		if err != nil {
			b.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
}

// BenchmarkTransport is the first-try path of a keyed POST with the key in
// its header, over an in-memory base.
func BenchmarkTransport(b *testing.B) {
	benchRoundTrip(b, &Transport{Base: roundTripFunc(benchBase)})
}

// BenchmarkTransportBodyField is BenchmarkTransport with the key written
// into a field of the JSON body instead of a header.
func BenchmarkTransportBodyField(b *testing.B) {
	benchRoundTrip(b, &Transport{Base: roundTripFunc(benchBase), KeyBodyField: "idempotency_key"})
}

// BenchmarkTransportBodyFieldPresent is BenchmarkTransportBodyField with
// the caller's key already in the body: nothing is inserted.
func BenchmarkTransportBodyFieldPresent(b *testing.B) {
	body := benchBody
	benchBody = []byte(`{"idempotency_key":"8e03978e-40d5-43e8-bc93-6894a57f9324","amount":4200,"currency":"usd","customer":"cus_123"}`)
	defer func() { benchBody = body }()
	benchRoundTrip(b, &Transport{Base: roundTripFunc(benchBase), KeyBodyField: "idempotency_key"})
}
