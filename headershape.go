package idem

import (
	"net/http"
	"sync/atomic"
)

// maxShapeNames is the most names a remembered header shape holds. Up to
// that many, looking each name up costs less than a walk of the map, whose
// random start and eight slots cost some 400 instructions even for a
// header of one name.
const maxShapeNames = 4

// headerShape is the set of names of a request's header, remembered from
// a walk (headerScan.scan) that found the key header and the first-sent
// header, if there, only under their canonical spellings. A header with as
// many names, each of them found by a lookup, has exactly these names, so
// a walk would find what the shape says: recall skips it.
type headerShape struct {
	name, sentName string // the header names the walk looked for
	names          [maxShapeNames]string
	n              int // names in use
	keyAt, sentAt  int // the index of name and of sentName in names, or -1
}

// headerShapes holds a Transport's last remembered shape for each number
// of names, 1 to maxShapeNames. A caller sends the same header names on
// every call, as a rule; one whose names change leaves a shape behind per
// walk, a small allocation on top of the walk itself.
type headerShapes [maxShapeNames]atomic.Pointer[headerShape]

// recall fills s from h without walking it, if h has the names of the
// shape of its size remembered for name and sentName (or none at all),
// and reports whether it did.
func (s *headerScan) recall(h http.Header, shapes *headerShapes, name, sentName string) bool {
	n := len(h)
	if n == 0 {
		return true // nothing to find
	}
	if n > maxShapeNames {
		return false
	}
	sh := shapes[n-1].Load()
	if sh == nil || sh.name != name || sh.sentName != sentName {
		return false
	}
	var key, sent []string
	for i, k := range sh.names[:n] {
		vs, ok := h[k]
		if !ok {
			return false
		}
		switch i {
		case sh.keyAt:
			key = vs
		case sh.sentAt:
			sent = vs
		}
	}
	s.key = key
	if sh.sentAt >= 0 {
		s.sent, s.hasSent = sent, true
	}
	return true
}

// remember keeps the names of the header s walked, unless it had more than
// maxShapeNames or one of the two headers under another spelling.
func (shapes *headerShapes) remember(s *headerScan, name, sentName string) {
	if s.count == 0 || s.count > maxShapeNames || s.respelt || s.sentRespelt {
		return
	}
	sh := &headerShape{name: name, sentName: sentName, names: s.names, n: s.count, keyAt: -1, sentAt: -1}
	for i, k := range sh.names[:sh.n] {
		switch {
		case k == name:
			sh.keyAt = i
		case k == sentName && sentName != "":
			sh.sentAt = i
		}
	}
	shapes[sh.n-1].Store(sh)
}
