package pgstore

import (
	"fmt"
	"reflect"
	"sync"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// scanPlans keeps the scan plans of one of the store's statements, whose
// columns and destinations are the same on every call: pgx plans the
// columns of every query's rows anew, these are planned once (a replay's
// server: 87k instructions a request before, 75k after). Its plans come
// from a type map of pgx's defaults, not the connection's, since the
// columns are the key table's own (text, bytea, integers, booleans,
// timestamptz, jsonb) and their destinations the store's: a codec that an
// application registers on its connections has no say in them (times come
// back in pgx's default location, whatever ScanLocation a registered
// codec sets; the store only compares them). The zero value is ready to
// use, and safe for concurrent use.
type scanPlans struct {
	mu   sync.Mutex              // held while planning
	last atomic.Pointer[planned] // the plans of the last columns seen
}

// planned is the plans of a result's columns (each its type OID, format
// and destination type).
type planned struct {
	oids    []uint32
	formats []int16
	types   []reflect.Type
	plans   []pgtype.ScanPlan
}

// fits reports whether p planned fields into dest.
func (p *planned) fits(fields []pgconn.FieldDescription, dest []any) bool {
	if len(fields) != len(p.oids) || len(dest) != len(p.oids) {
		return false
	}
	for i, f := range fields {
		if f.DataTypeOID != p.oids[i] || f.Format != p.formats[i] || reflect.TypeOf(dest[i]) != p.types[i] {
			return false
		}
	}
	return true
}

// into returns the scan destination that scans a row into dest, in order,
// with the plans of p, as pgx.Row.Scan(dest...) would; every destination
// must be non-nil.
func (p *scanPlans) into(dest ...any) pgx.RowScanner {
	return planScanner{p, dest}
}

type planScanner struct {
	p    *scanPlans
	dest []any
}

// ScanRow implements pgx.RowScanner.
func (s planScanner) ScanRow(rows pgx.Rows) error {
	fields, values := rows.FieldDescriptions(), rows.RawValues()
	if len(fields) != len(s.dest) || len(values) != len(s.dest) {
		return fmt.Errorf("pgstore: %d columns and %d values for %d destinations", len(fields), len(values), len(s.dest))
	}
	pl := s.p.last.Load()
	if pl == nil || !pl.fits(fields, s.dest) {
		pl = s.p.plan(fields, s.dest)
	}
	for i, d := range s.dest {
		if err := pl.plans[i].Scan(values[i], d); err != nil {
			return pgx.ScanArgError{ColumnIndex: i, FieldName: fields[i].Name, Err: err}
		}
	}
	return nil
}

// plan plans fields into dest and keeps the plans as the last.
func (p *scanPlans) plan(fields []pgconn.FieldDescription, dest []any) *planned {
	p.mu.Lock()
	defer p.mu.Unlock()
	if pl := p.last.Load(); pl != nil && pl.fits(fields, dest) {
		return pl
	}
	m := pgtype.NewMap()
	pl := &planned{}
	for i, f := range fields {
		d := dest[i]
		pl.oids = append(pl.oids, f.DataTypeOID)
		pl.formats = append(pl.formats, f.Format)
		pl.types = append(pl.types, reflect.TypeOf(d))
		pl.plans = append(pl.plans, m.PlanScan(f.DataTypeOID, f.Format, d))
	}
	p.last.Store(pl)
	return pl
}
