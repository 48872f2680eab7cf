package main

import (
	"testing"
	"time"
)

// ledger returns n operations that succeeded, and a database that holds
// exactly their payments and charges.
func ledger(n int) ([]*op, dbState) {
	var ops []*op
	var db dbState
	for i := 1; i <= n; i++ {
		o := newOp(i, account{"sk", "c0"}, time.Now())
		o.state, o.calls = succeeded, 1
		o.paymentID, o.chargeID = "pay_"+o.key, "ch_"+o.key
		ops = append(ops, o)
		db.payments = append(db.payments, paymentRow{
			id: o.paymentID, clientID: "c0", key: o.key, customer: o.customer, chargeID: o.chargeID, amount: o.amount,
		})
		db.charges = append(db.charges, chargeRow{id: o.chargeID, key: "idem_ch_" + o.key, amount: o.amount})
	}
	return ops, db
}

func TestCheck(t *testing.T) {
	tests := []struct {
		name                       string
		mutate                     func([]*op, *dbState)
		duplicates, lost, failures int // failures: mismatched + phantom + failed
	}{
		{"clean", func([]*op, *dbState) {}, 0, 0, 0},
		{"two payments for one operation", func(ops []*op, db *dbState) {
			p := db.payments[0]
			p.id, p.chargeID = "pay_second", "ch_second"
			db.payments = append(db.payments, p)
		}, 1, 0, 0},
		{"two charges for one operation", func(ops []*op, db *dbState) {
			c := db.charges[1]
			c.id, c.key = "ch_second", "idem_ch_other_operation"
			db.charges = append(db.charges, c)
		}, 1, 0, 0},
		{"a payment of no operation", func(ops []*op, db *dbState) {
			db.payments = append(db.payments, paymentRow{id: "pay_x", customer: "cus_other", amount: 1})
		}, 1, 0, 0},
		{"a charge of no operation", func(ops []*op, db *dbState) {
			db.charges = append(db.charges, chargeRow{id: "ch_x", amount: 1})
		}, 1, 0, 0},
		{"never answered", func(ops []*op, db *dbState) {
			ops[0].state = pending
		}, 0, 1, 0},
		{"never answered and never paid", func(ops []*op, db *dbState) {
			ops[0].state = pending
			db.payments = db.payments[1:]
			db.charges = db.charges[1:]
		}, 0, 1, 0},
		{"told paid, not in the database", func(ops []*op, db *dbState) {
			db.payments = db.payments[1:]
		}, 0, 1, 0},
		{"told another payment id", func(ops []*op, db *dbState) {
			ops[2].paymentID = "pay_other"
		}, 0, 0, 1},
		{"payment made with another key", func(ops []*op, db *dbState) {
			db.payments[2].key = "another-key"
		}, 0, 0, 1},
		{"payment refers to a charge the processor does not hold", func(ops []*op, db *dbState) {
			db.charges = db.charges[1:]
		}, 0, 0, 1},
		{"told it failed, yet paid", func(ops []*op, db *dbState) {
			ops[1].state = failed
		}, 0, 0, 2},
		{"failed and not paid", func(ops []*op, db *dbState) {
			ops[1].state = failed
			db.payments = append(db.payments[:1], db.payments[2:]...)
		}, 0, 0, 1},
		{"vanished, paid by a sweeper", func(ops []*op, db *dbState) {
			ops[0].state, ops[0].vanished = pending, true
		}, 0, 0, 0},
		{"vanished, never charged", func(ops []*op, db *dbState) {
			ops[0].state, ops[0].vanished = pending, true
			db.payments, db.charges = db.payments[1:], db.charges[1:]
		}, 0, 0, 0},
		{"vanished, paid twice", func(ops []*op, db *dbState) {
			ops[0].state, ops[0].vanished = pending, true
			p := db.payments[0]
			p.id = "pay_second"
			db.payments = append(db.payments, p)
		}, 1, 0, 0},
		{"vanished, paid with another key", func(ops []*op, db *dbState) {
			ops[0].state, ops[0].vanished = pending, true
			db.payments[0].key = "another-key"
		}, 0, 0, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ops, db := ledger(3)
			tt.mutate(ops, &db)
			v := check(ops, db)
			failures := v.mismatched + v.phantom + v.failed
			if v.duplicates() != tt.duplicates || v.lost() != tt.lost || failures != tt.failures {
				t.Errorf("duplicates %d, lost %d, failures %d; want %d, %d, %d (problems: %q)",
					v.duplicates(), v.lost(), failures, tt.duplicates, tt.lost, tt.failures, v.problems)
			}
			if ok := v.err() == nil; ok != (tt.duplicates+tt.lost+tt.failures == 0) {
				t.Errorf("err() = %v for this verdict", v.err())
			}
			if v.operations != 3 {
				t.Errorf("operations %d, want 3", v.operations)
			}
		})
	}
}

// TestCheckVanishedCharge: an operation whose client vanished is not lost,
// but its charge without a payment (nobody settled it) fails the run.
func TestCheckVanishedCharge(t *testing.T) {
	ops, db := ledger(3)
	ops[0].state, ops[0].vanished = pending, true
	db.payments = db.payments[1:]
	v := check(ops, db)
	if v.lost() != 0 || v.vanished != 1 || v.vanishedPaid != 0 || v.orphanCharges != 1 || v.err() == nil {
		t.Errorf("lost %d, vanished %d (%d paid), charges without a payment %d, err %v; want 0, 1 (0), 1 and an error",
			v.lost(), v.vanished, v.vanishedPaid, v.orphanCharges, v.err())
	}
}
