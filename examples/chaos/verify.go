package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
)

// paymentRow is a row of the payments table.
type paymentRow struct {
	id, clientID, key, customer, chargeID string
	amount                                int64
}

// chargeRow is a row of the charges table (the fake card processor's).
type chargeRow struct {
	id, key string
	amount  int64
}

// dbState is what the database holds at the end of a run.
type dbState struct {
	payments    []paymentRow
	charges     []chargeRow
	keysStarted int // idempotency keys left started
}

// load reads the run's tables.
func (d *database) load(ctx context.Context) (dbState, error) {
	var st dbState
	rows, _ := d.pool.Query(ctx, `SELECT payment_id, client_id, idempotency_key, customer_id, coalesce(charge_id, ''), amount FROM `+d.table("payments"))
	var err error
	st.payments, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (p paymentRow, err error) {
		err = r.Scan(&p.id, &p.clientID, &p.key, &p.customer, &p.chargeID, &p.amount)
		return p, err
	})
	if err != nil {
		return st, fmt.Errorf("reading payments: %w", err)
	}
	rows, _ = d.pool.Query(ctx, `SELECT charge_id, idempotency_key, amount FROM `+d.table("charges"))
	st.charges, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (c chargeRow, err error) {
		err = r.Scan(&c.id, &c.key, &c.amount)
		return c, err
	})
	if err != nil {
		return st, fmt.Errorf("reading charges: %w", err)
	}
	err = d.pool.QueryRow(ctx, `SELECT count(*) FROM `+d.table("idempotency_keys")+` WHERE status = 'started'`).Scan(&st.keysStarted)
	if err != nil {
		return st, fmt.Errorf("reading keys: %w", err)
	}
	return st, nil
}

// verdict is the outcome of the final check.
type verdict struct {
	operations, succeeded, failed, unresolved int

	// Duplicates: more than one payment, or more than one downstream
	// charge, for one operation; or a payment or charge of no operation.
	extraPayments, extraCharges, strayPayments, strayCharges int
	// chargedTwice: operations charged more than once downstream.
	chargedTwice int
	// Lost: a client never learned the outcome (unresolved), or was told
	// of a payment the database does not hold.
	missing int
	// Inconsistent: what the client was told differs from the database
	// (another payment or charge id, another key), or a definitive error
	// for an operation that was in fact performed.
	mismatched, phantom int
	// orphanCharges: downstream charges that no payment refers to (a
	// charge with no payment: money taken and not recorded).
	orphanCharges int
	// invalid: operations whose first request held invalid text;
	// acceptedInvalid: those a server took instead of answering 400.
	invalid, acceptedInvalid int
	// vanished: operations whose client vanished after an unknown outcome,
	// left out of the lost ones; vanishedPaid: those that hold a payment
	// (a charge made before the client vanished became one, by a
	// sweeper's settlement or an earlier attempt's completion).
	vanished, vanishedPaid int

	problems []string // the first few, for the report
}

// maxProblems caps the problems listed in a report.
const maxProblems = 20

func (v *verdict) problem(format string, args ...any) {
	if len(v.problems) < maxProblems {
		v.problems = append(v.problems, fmt.Sprintf(format, args...))
	}
}

// duplicates counts the payments and charges beyond one per operation.
func (v *verdict) duplicates() int {
	return v.extraPayments + v.extraCharges + v.strayPayments + v.strayCharges
}

// lost counts the operations whose client never learned the outcome, or
// whose reported payment is missing.
func (v *verdict) lost() int { return v.unresolved + v.missing }

// err returns nil when every invariant holds.
func (v *verdict) err() error {
	var errs []error
	if n := v.duplicates(); n > 0 {
		errs = append(errs, fmt.Errorf("%d duplicate payments or charges", n))
	}
	if n := v.lost(); n > 0 {
		errs = append(errs, fmt.Errorf("%d lost operations", n))
	}
	if v.orphanCharges > 0 {
		errs = append(errs, fmt.Errorf("%d downstream charges without a payment", v.orphanCharges))
	}
	if v.acceptedInvalid > 0 {
		errs = append(errs, fmt.Errorf("%d requests with invalid text accepted", v.acceptedInvalid))
	}
	if v.mismatched+v.phantom > 0 {
		errs = append(errs, fmt.Errorf("%d operations whose answer differs from the database", v.mismatched+v.phantom))
	}
	if v.failed > 0 {
		errs = append(errs, fmt.Errorf("%d valid payments ended in a definitive error", v.failed))
	}
	if len(errs) == 0 {
		return nil
	}
	return fmt.Errorf("invariant violated: %w", errors.Join(errs...))
}

// check compares what the clients learned with what the database holds.
// Every operation must have exactly one payment, made with its key, whose
// ids are the ones its client was told, and at most one charge; every
// operation must have ended in success (its request is valid). An
// operation whose client vanished was told nothing: it must have at most
// one payment, made with its key for its amount, and at most one charge;
// whether it has one depends on whether it was charged, and the final
// check, every charge has its payment, holds for it too. ops must no longer
// change.
func check(ops []*op, db dbState) verdict {
	v := verdict{operations: len(ops)}
	byCustomer := make(map[string][]paymentRow)
	for _, p := range db.payments {
		byCustomer[p.customer] = append(byCustomer[p.customer], p)
	}
	byAmount := make(map[int64][]chargeRow)
	for _, c := range db.charges {
		byAmount[c.amount] = append(byAmount[c.amount], c)
	}
	known := make(map[int64]bool, len(ops))
	for _, o := range ops {
		known[o.amount] = true
		if o.invalid {
			v.invalid++
		}
		if o.acceptedInvalid {
			v.acceptedInvalid++
			v.problem("op %d (client %s, key %s): a request with a NUL in its customer was accepted", o.n, o.account.id, o.key)
		}
		pays, charges := byCustomer[o.customer], byAmount[o.amount]
		delete(byCustomer, o.customer)
		if n := len(pays); n > 1 {
			v.extraPayments += n - 1
			v.problem("op %d (client %s, key %s): %d payments: %s", o.n, o.account.id, o.key, n, paymentIDs(pays))
		}
		if n := len(charges); n > 1 {
			v.extraCharges += n - 1
			v.chargedTwice++
			v.problem("op %d (client %s, key %s): %d downstream charges: %s", o.n, o.account.id, o.key, n, chargeIDs(charges))
		}
		if o.vanished {
			v.vanished++
			if len(pays) == 1 {
				v.vanishedPaid++
				v.checkPayment(o, pays[0], charges)
			}
			continue
		}
		switch o.state {
		case pending:
			v.unresolved++
			v.problem("op %d (client %s, key %s): no definitive answer after %d calls (last: %s); %d payments in the database",
				o.n, o.account.id, o.key, o.calls, o.last, len(pays))
			continue
		case failed:
			v.failed++
			v.problem("op %d (client %s, key %s): definitive error: %s", o.n, o.account.id, o.key, o.last)
			if len(pays) > 0 {
				v.phantom++
				v.problem("op %d (client %s, key %s): told it failed, yet paid: %s", o.n, o.account.id, o.key, paymentIDs(pays))
			}
			continue
		}
		v.succeeded++
		if len(pays) == 0 {
			v.missing++
			v.problem("op %d (client %s, key %s): told payment %s, but no payment in the database", o.n, o.account.id, o.key, o.paymentID)
			continue
		}
		p := pays[0]
		switch {
		case len(pays) > 1:
			// counted above
		case p.id != o.paymentID || p.chargeID != o.chargeID:
			v.mismatched++
			v.problem("op %d (client %s, key %s): told payment %s charge %s, database holds %s charge %s",
				o.n, o.account.id, o.key, o.paymentID, o.chargeID, p.id, p.chargeID)
		default:
			v.checkPayment(o, p, charges)
		}
	}
	for _, pays := range byCustomer {
		v.strayPayments += len(pays)
		v.problem("payments of no operation: %s", paymentIDs(pays))
	}
	for amount, charges := range byAmount {
		if !known[amount] {
			v.strayCharges += len(charges)
			v.problem("charges of no operation: %s", chargeIDs(charges))
		}
	}
	paid := make(map[string]bool, len(db.payments))
	for _, p := range db.payments {
		paid[p.chargeID] = true
	}
	for _, c := range db.charges {
		if !paid[c.id] {
			v.orphanCharges++
			v.problem("charge %s (amount %d) has no payment", c.id, c.amount)
		}
	}
	return v
}

// checkPayment checks that p, the one payment of o, was made by its client
// with its key for its amount, and refers to its charge.
func (v *verdict) checkPayment(o *op, p paymentRow, charges []chargeRow) {
	switch {
	case p.clientID != o.account.id || p.key != o.key || p.amount != o.amount:
		v.mismatched++
		v.problem("op %d (client %s, key %s): payment %s was made by client %s with key %s for %d",
			o.n, o.account.id, o.key, p.id, p.clientID, p.key, p.amount)
	case !slices.ContainsFunc(charges, func(c chargeRow) bool { return c.id == p.chargeID }):
		v.mismatched++
		v.problem("op %d (client %s, key %s): payment %s refers to charge %q, the processor holds %s",
			o.n, o.account.id, o.key, p.id, p.chargeID, chargeIDs(charges))
	}
}

func paymentIDs(ps []paymentRow) string {
	ids := make([]string, len(ps))
	for i, p := range ps {
		ids[i] = fmt.Sprintf("%s (key %s, charge %s)", p.id, p.key, p.chargeID)
	}
	return strings.Join(ids, ", ")
}

func chargeIDs(cs []chargeRow) string {
	if len(cs) == 0 {
		return "none"
	}
	ids := make([]string, len(cs))
	for i, c := range cs {
		ids[i] = fmt.Sprintf("%s (downstream key %s)", c.id, c.key)
	}
	return strings.Join(ids, ", ")
}
