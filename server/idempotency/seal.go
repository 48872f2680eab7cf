package idempotency

import (
	"bytes"
	"context"
	"crypto/aes"
	"crypto/cipher"
	"crypto/hkdf"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"mime"
	"strings"
)

// SealedMediaType is the content type a sealed response is stored with,
// followed by the id of the key that sealed it:
// "application/vnd.idemkit.sealed; key=2026-01". It is reserved: a handler
// must not answer it (its replays would be refused as sealed).
const SealedMediaType = "application/vnd.idemkit.sealed"

// ProblemResponseSealed (500): the key's operation was done and its outcome
// stored sealed ([Sealed]), and this server cannot open it: the key that
// sealed it is not among its keys (withdrawn, or sealing is off on this
// server), or the stored outcome was altered or copied from another key's
// row. The operation is not run again, and the key is not claimed anew: a
// retry with the same key gets the same answer until a server that holds
// the key answers it.
const ProblemResponseSealed = "https://idemkit.dev/problems/idempotency-response-sealed"

// ErrCannotOpen is returned (wrapped, with the reason) by [SealKeys.Open]
// for a sealed response it cannot open: sealed with a key it does not hold,
// or altered, or copied from another client's or key's row.
var ErrCannotOpen = errors.New("idempotency: the sealed response cannot be opened")

// Sizes and labels of the sealed format, version 1.
const (
	sealVersion   = 1
	sealSecretLen = 32 // bytes of a SealKey's Secret: AES-256
	sealSaltLen   = 16 // random bytes per sealed response, from which its own key is derived
	maxSealKeyID  = 64
	sealInfo      = "idem seal v1" // HKDF info, and the first bytes of the additional data
)

// SealKey is one key of a [SealKeys] set.
type SealKey struct {
	// ID names the key. It is stored with every response the key seals, so
	// the response is opened with the same key after a rotation. 1 to 64
	// characters out of A-Z, a-z, 0-9, '.', '_' and '-'; a date
	// ("2026-01") does well.
	ID string
	// Secret is the key: 32 random bytes (from crypto/rand, or
	// `openssl rand -base64 32`). Keep it out of the database.
	Secret []byte
	// OpenOnly, on the first key, turns sealing off while keeping the keys
	// that open what was sealed: no new response is sealed, and the
	// responses sealed before still replay until they expire. It changes
	// nothing on another key, since only the first one seals.
	OpenOnly bool
}

// SealKeys are the keys that seal stored responses at rest ([Sealed]): the
// first key seals every new response (unless it is [SealKey.OpenOnly]), and
// every key opens the responses it sealed. To rotate, put a new key first
// and keep the old ones after it until the responses they sealed have
// expired (the retention after their completion; the id in the stored
// content type tells which rows each key still opens). A SealKeys is
// immutable and safe for concurrent use.
type SealKeys struct {
	sealer  *sealKey // nil: nothing is sealed
	byID    map[string]*sealKey
	require bool // a response that is not sealed is refused (RequireSealed)
}

type sealKey struct {
	id          string
	secret      []byte
	contentType string // SealedMediaType with this key's id
}

// NewSealKeys returns the key set of keys, the first one sealing. It copies
// the secrets. It returns an error for no key, a duplicated or malformed
// id, or a secret that is not 32 bytes long; the error never shows a
// secret, nor an id that is malformed (a secret in the id's place).
func NewSealKeys(keys ...SealKey) (*SealKeys, error) {
	if len(keys) == 0 {
		return nil, errors.New("idempotency: NewSealKeys needs at least one key")
	}
	ks := &SealKeys{byID: make(map[string]*sealKey, len(keys))}
	for i, k := range keys {
		if !validSealKeyID(k.ID) {
			// Not shown: an id that is not one may be a secret put in its place.
			return nil, fmt.Errorf("idempotency: seal key id of key %d (of %d): want 1 to %d characters out of A-Z, a-z, 0-9, '.', '_' and '-'", i+1, len(keys), maxSealKeyID)
		}
		if len(k.Secret) != sealSecretLen {
			return nil, fmt.Errorf("idempotency: seal key %q is %d bytes long: want %d random bytes", k.ID, len(k.Secret), sealSecretLen)
		}
		if _, dup := ks.byID[k.ID]; dup {
			return nil, fmt.Errorf("idempotency: seal key id %q is given twice", k.ID)
		}
		sk := &sealKey{id: k.ID, secret: append([]byte(nil), k.Secret...), contentType: SealedMediaType + "; key=" + k.ID}
		ks.byID[k.ID] = sk
		if i == 0 && !k.OpenOnly {
			ks.sealer = sk
		}
	}
	return ks, nil
}

// ErrNotSealed is returned (wrapped) by the [Store.Claim] of a [Sealed]
// store whose keys require seals ([SealKeys.RequireSealed]) for a
// completed key that the request would replay and whose stored response
// is not sealed. [Middleware] answers it 500 [ProblemInternal], runs
// nothing, and logs it at Error.
var ErrNotSealed = errors.New("idempotency: the stored response is not sealed, and the seal keys require seals")

// RequireSealed returns the key set k that also refuses, in a [Sealed]
// store, to replay a stored response that is not sealed: a row written
// in the clear (by whoever can write the store, or before sealing was
// turned on) is never served. Turn it on when every server that shares
// the store seals and the last response stored in the clear has expired
// (a retention after the last server started sealing); until then, such
// responses are still replayed, which is why it is off by default. It
// returns an error for keys whose first key is [SealKey.OpenOnly], which
// store new responses in the clear.
func (k *SealKeys) RequireSealed() (*SealKeys, error) {
	if k.sealer == nil {
		return nil, errors.New("idempotency: RequireSealed with an open-only first key: its new responses are stored in the clear, and would be refused")
	}
	req := *k
	req.require = true
	return &req, nil
}

func validSealKeyID(id string) bool {
	if len(id) == 0 || len(id) > maxSealKeyID {
		return false
	}
	for _, c := range []byte(id) {
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9', c == '.', c == '_', c == '-':
		default:
			return false
		}
	}
	return true
}

// sealKeyID reports whether resp is sealed and, if so, the id of the key
// that sealed it, as its content type names it. A content type is sealed
// when its media type is [SealedMediaType], compared as RFC 9110 compares
// media types (without regard to case, parameters aside): a handler's own
// type that only begins like it (application/vnd.idemkit.sealedreport+json)
// is not. The id is "" when the content type is sealed but does not carry
// exactly one well-formed key parameter.
func sealKeyID(resp StoredResponse) (id string, sealed bool) {
	ct := resp.ContentType
	// Most responses are not sealed: they are not parsed.
	if len(ct) < len(SealedMediaType) || !strings.EqualFold(ct[:len(SealedMediaType)], SealedMediaType) {
		return "", false
	}
	if id, ok := strings.CutPrefix(ct, SealedMediaType+"; key="); ok && validSealKeyID(id) {
		return id, true // as Seal writes it: no parse
	}
	mt, params, err := mime.ParseMediaType(ct)
	if err != nil {
		// Malformed parameters (a key given twice, say): sealed, and
		// unreadable, when the media type is.
		base, _, _ := strings.Cut(ct, ";")
		return "", strings.EqualFold(strings.TrimSpace(base), SealedMediaType)
	}
	if mt != SealedMediaType { // ParseMediaType lowercases it
		return "", false
	}
	id = params["key"]
	if len(params) != 1 || !validSealKeyID(id) {
		return "", true
	}
	return id, true
}

// Seal returns resp sealed with the first key, for the key key of client
// clientID and its operation operationID ([Claim.OperationID]): the same
// status, in the clear (stores keep and check it), the content type
// [SealedMediaType] naming the key, no other header, and a body that holds
// the content type, the headers and the body of resp, encrypted and
// authenticated with AES-256-GCM. The client, the key, the operation, the
// status and the key's id are authenticated with it, so the sealed
// response opens only for the same client, key and operation (whose ID is
// derived from the request: see [ClaimRequest.OperationID]), with the
// same status.
// Each response is encrypted under its own key, derived from the seal key
// and 16 random bytes with HKDF-SHA256, so a seal key has no practical
// limit on how many responses it seals. Seal returns resp unchanged when
// the first key is [SealKey.OpenOnly].
func (k *SealKeys) Seal(clientID, key, operationID string, resp StoredResponse) (StoredResponse, error) {
	s := k.sealer
	if s == nil {
		return resp, nil
	}
	// The envelope: version, key id, salt, then the ciphertext of
	// uvarint-prefixed content type, header count and header names and
	// values, then the body.
	plainLen := binary.MaxVarintLen64 * (2 + 2*len(resp.Header))
	plainLen += len(resp.ContentType) + len(resp.Body)
	for name, value := range resp.Header {
		plainLen += len(name) + len(value)
	}
	head := 2 + len(s.id) + sealSaltLen
	env := make([]byte, head, head+plainLen+16)
	env[0] = sealVersion
	env[1] = byte(len(s.id))
	copy(env[2:], s.id)
	salt := env[2+len(s.id) : head]
	rand.Read(salt)
	env = appendLenString(env, resp.ContentType)
	env = binary.AppendUvarint(env, uint64(len(resp.Header)))
	for name, value := range resp.Header {
		env = appendLenString(env, name)
		env = appendLenString(env, value)
	}
	env = append(env, resp.Body...)
	aead, err := s.aead(salt)
	if err != nil {
		return StoredResponse{}, err
	}
	// The plaintext is sealed in place: dst is exactly its start.
	env = aead.Seal(env[:head], zeroNonce[:], env[head:], sealAAD(clientID, key, operationID, resp.Status, s.id))
	return StoredResponse{Status: resp.Status, ContentType: s.contentType, Body: env}, nil
}

// Open returns the response that resp, sealed by [SealKeys.Seal] for the
// key key of client clientID and its operation operationID, holds; a
// response that is not sealed is returned as it is (one stored before
// sealing was turned on). It returns an error wrapping [ErrCannotOpen]
// when resp was sealed with a key k does not hold, or was altered, or was
// sealed for another client, key, operation or status.
func (k *SealKeys) Open(clientID, key, operationID string, resp StoredResponse) (StoredResponse, error) {
	id, sealed := sealKeyID(resp)
	if !sealed {
		return resp, nil
	}
	env := resp.Body
	if id == "" || len(env) < 2 || env[0] != sealVersion || int(env[1]) != len(id) || len(env) < 2+len(id)+sealSaltLen ||
		string(env[2:2+len(id)]) != id {
		return StoredResponse{}, fmt.Errorf("%w: its content type (%q) or its format was altered", ErrCannotOpen, resp.ContentType)
	}
	s := k.byID[id]
	if s == nil {
		return StoredResponse{}, fmt.Errorf("%w: it was sealed with key %q, which is not among the seal keys (withdrawn too early?)", ErrCannotOpen, id)
	}
	head := 2 + len(id) + sealSaltLen
	aead, err := s.aead(env[2+len(id) : head])
	if err != nil {
		return StoredResponse{}, err
	}
	plain, err := aead.Open(nil, zeroNonce[:], env[head:], sealAAD(clientID, key, operationID, resp.Status, id))
	if err != nil {
		return StoredResponse{}, fmt.Errorf("%w: it does not open with key %q: it was altered, or copied from another client's or key's row, or its status was changed", ErrCannotOpen, id)
	}
	out := StoredResponse{Status: resp.Status}
	var n uint64
	ok := true
	out.ContentType, plain, ok = readString(plain, ok)
	n, plain, ok = readUvarint(plain, ok)
	if ok && n > 0 && n <= uint64(len(plain)) {
		out.Header = make(map[string]string, n)
		for range n {
			var name, value string
			name, plain, ok = readString(plain, ok)
			value, plain, ok = readString(plain, ok)
			out.Header[name] = value
		}
	}
	if !ok || uint64(len(out.Header)) != n {
		// Authenticated, so written by a Seal: a bug, not an attack.
		return StoredResponse{}, fmt.Errorf("%w: its contents are malformed", ErrCannotOpen)
	}
	if len(plain) > 0 {
		out.Body = plain
	}
	return out, nil
}

// zeroNonce is the nonce of every sealed response: each is encrypted under
// a key of its own, derived from a random salt, so no key ever sees a
// nonce twice.
var zeroNonce [12]byte

// aead returns the AES-256-GCM of the response key derived from s and
// salt: HKDF-SHA256's expansion of the seal key, with the salt in the
// info. The extraction step is skipped, as RFC 5869 (section 3.3) allows
// for a key that is already uniformly random, as a seal key's 32 random
// bytes are.
func (s *sealKey) aead(salt []byte) (cipher.AEAD, error) {
	rk, err := hkdf.Expand(sha256.New, s.secret, sealInfo+string(salt), 32)
	if err != nil {
		return nil, err
	}
	block, err := aes.NewCipher(rk)
	if err != nil {
		return nil, err
	}
	return cipher.NewGCM(block)
}

// sealAAD returns the additional data a sealed response is bound to: the
// row's client, key and operation (so that a key reused for another
// operation, after it expired, cannot be given an old answer back), the
// status and the seal key's id, each length-prefixed so that no two tuples
// give the same bytes.
func sealAAD(clientID, key, operationID string, status int, keyID string) []byte {
	aad := make([]byte, 0, len(sealInfo)+len(clientID)+len(key)+len(operationID)+len(keyID)+5*binary.MaxVarintLen64)
	aad = appendLenString(aad, sealInfo)
	aad = appendLenString(aad, clientID)
	aad = appendLenString(aad, key)
	aad = appendLenString(aad, operationID)
	aad = binary.AppendUvarint(aad, uint64(status))
	return appendLenString(aad, keyID)
}

func appendLenString(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

func readUvarint(b []byte, ok bool) (uint64, []byte, bool) {
	if !ok {
		return 0, b, false
	}
	n, l := binary.Uvarint(b)
	if l <= 0 {
		return 0, b, false
	}
	return n, b[l:], true
}

func readString(b []byte, ok bool) (string, []byte, bool) {
	n, b, ok := readUvarint(b, ok)
	if !ok || n > uint64(len(b)) {
		return "", b, false
	}
	return string(b[:n]), b[n:], true
}

// Sealed returns store with its stored responses sealed at rest by keys:
// [Tx.Complete] seals the response before store keeps it
// ([SealKeys.Seal]), and [Store.Claim] opens the response of a completed
// key it returns ([SealKeys.Open]), so [Middleware] replays it byte for
// byte. Give Middleware the returned store:
//
//	keyed := idempotency.Middleware(idempotency.Sealed(pgstore.New(pool), keys), opts)
//
// Sealing protects what a stored response holds (a card's last digits, a
// vended token, an address) from whoever reads the store but not the keys:
// backups, replicas, support staff. What a request was (method, path,
// fingerprint), the status and the key's state stay in the clear, since
// the store works with them. A sealed response opens only for the row it
// was sealed for, so one copied to another client's or key's row, or whose
// status was changed, does not open; the store's other columns are not
// protected against whoever can write them (a deleted row is an operation
// run again, as without sealing).
//
// A response Claim cannot open (sealed with a key that is not in keys, or
// altered) is returned still sealed, and Middleware answers 500
// [ProblemResponseSealed] for it: it never runs the operation again, nor
// claims the key anew. Middleware answers the same to a sealed response
// found by a server without Sealed. A response stored without sealing
// (before sealing was turned on) is returned as it is, unless keys
// require seals ([SealKeys.RequireSealed]): then Claim returns an error
// wrapping [ErrNotSealed] for the request that would replay it, and
// Middleware answers 500, running nothing.
//
// A handler reaches its store's own unit of work as before: the Tx that
// Begin returns wraps store's, and [TxFromContext] (so pgstore.Tx
// and [MemoryStore.Stage]) unwraps it. When store is [Sweepable] or an
// [Inspector], so is the returned Store: a [Sweeper]'s settlements are
// sealed like a handler's outcomes, and [Inspector.Lookup] shows a body as
// it is stored, sealed. Other methods of store are not reachable through
// the returned Store; keep store for them.
//
// Rolling out. A server of an idem release without sealing replays a
// sealed response as it is stored, ciphertext: turn sealing on once every
// server that shares the store runs a release with it, and to turn it off,
// keep the keys with the first one [SealKey.OpenOnly] until the last
// response it sealed has expired.
func Sealed(store Store, keys *SealKeys) Store {
	if keys == nil {
		panic("idempotency: Sealed needs keys (NewSealKeys)")
	}
	s := &sealedStore{Store: store, keys: keys}
	// The sweeper's and the operators' interfaces go through, so that a
	// settlement is sealed like a handler's outcome.
	sw, sweepable := store.(Sweepable)
	in, inspectable := store.(Inspector)
	switch {
	case sweepable && inspectable:
		return &struct {
			*sealedStore
			Sweepable
			Inspector
		}{s, sw, in}
	case sweepable:
		return &struct {
			*sealedStore
			Sweepable
		}{s, sw}
	case inspectable:
		return &struct {
			*sealedStore
			Inspector
		}{s, in}
	}
	return s
}

// sealedStore is the Store of [Sealed].
type sealedStore struct {
	Store
	keys *SealKeys
}

// Claim implements [Store.Claim]: it opens a returned record's response,
// or leaves it sealed when it cannot.
func (s *sealedStore) Claim(ctx context.Context, req ClaimRequest) (ClaimResult, error) {
	res, err := s.Store.Claim(ctx, req)
	return s.opened(req, res, err)
}

// ClaimInTx implements [TxClaimer.ClaimInTx] with the store's, or with its
// Claim when it is not a TxClaimer (the claim then says so).
func (s *sealedStore) ClaimInTx(ctx context.Context, req ClaimRequest) (ClaimResult, error) {
	claim := s.Store.Claim
	if tc, ok := s.Store.(TxClaimer); ok {
		claim = tc.ClaimInTx
	}
	res, err := claim(ctx, req)
	return s.opened(req, res, err)
}

// opened returns the result of a claim of req with its record's response
// opened, or left sealed when it cannot be.
func (s *sealedStore) opened(req ClaimRequest, res ClaimResult, err error) (ClaimResult, error) {
	if err != nil || res.Record == nil || res.Record.Response == nil {
		return res, err
	}
	rec := res.Record
	if _, sealed := sealKeyID(*rec.Response); !sealed {
		if s.keys.require && bytes.Equal(rec.Fingerprint, req.Fingerprint) {
			// The request would replay it (another one gets its 422).
			return ClaimResult{}, fmt.Errorf("%w: the response of key %q of client %q is stored in the clear; it is not replayed",
				ErrNotSealed, rec.Key, rec.ClientID)
		}
		return res, nil
	}
	if opened, err := s.keys.Open(rec.ClientID, rec.Key, rec.OperationID, *rec.Response); err == nil {
		rec.Response = &opened
	}
	return res, nil
}

// Begin implements [Store.Begin]: the unit of work seals its outcome.
func (s *sealedStore) Begin(ctx context.Context, c Claim) (Tx, error) {
	tx, err := s.Store.Begin(ctx, c)
	if err != nil {
		return nil, err
	}
	return &sealedTx{tx: tx, keys: s.keys, claim: c}, nil
}

// sealedTx is the unit of work of a [Sealed] store.
type sealedTx struct {
	tx    Tx
	keys  *SealKeys
	claim Claim
}

// Complete implements [Tx.Complete]: it seals resp and completes the
// store's unit of work with it. A content type or header that is not valid
// text is refused as the stores refuse it ([ErrInvalidText]), though it
// would be sealed, so that sealing changes nothing of what is stored; the
// unit of work is rolled back then.
func (t *sealedTx) Complete(ctx context.Context, resp StoredResponse) error {
	err := checkText(resp.ContentType)
	for name, v := range resp.Header {
		if err == nil {
			err = checkText(name, v)
		}
	}
	if err == nil {
		resp, err = t.keys.Seal(t.claim.ClientID, t.claim.Key, t.claim.OperationID, resp)
	}
	if err != nil {
		_ = t.tx.Rollback(ctx)
		return err
	}
	return t.tx.Complete(ctx, resp)
}

// Rollback implements [Tx.Rollback].
func (t *sealedTx) Rollback(ctx context.Context) error { return t.tx.Rollback(ctx) }

// Unwrap returns the store's own unit of work, for [TxFromContext].
func (t *sealedTx) Unwrap() Tx { return t.tx }
