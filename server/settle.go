package server

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/idemkit/idem/server/idempotency"
)

// settle is the payments API's [idempotency.SweepFunc]: it settles the
// payment of an abandoned key as its request would have, had it not
// crashed or failed after the charge. The processor is asked for the
// charge under the operation's downstream key (chargeKey), without making
// one:
//
//   - a charge becomes the operation's payment, written in the key's unit
//     of work as the handler writes it, and the key completes with the 201
//     the client would have got (the payment as create answers it), which
//     every retry of the key then gets;
//   - no charge releases the key: nothing of the payment was done, and the
//     client's retry, if it comes, runs it (the same operation, the same
//     downstream key);
//   - a processor that cannot tell leaves the key for the next sweep.
//
// "No charge" means none will come: the sweeper takes a key only after
// its grace, which [Config] keeps at least as long as the processor
// timeout, so the charge call of a request that lost its lease has ended
// by then (its lease ran out after its last renewal, and its call began
// before that and lasts at most the processor timeout). A process frozen
// between its claim and its charge for longer than the lease and the
// grace together could still charge afterwards, which no fence of the key
// store can stop; its client's retry finds that charge, and an operator
// finds it in the processor's records.
func (a *payments) settle(ctx context.Context, k idempotency.KeyInfo) (idempotency.Settlement, error) {
	if k.Method != http.MethodPost || k.Path != "/v1/payments" {
		return idempotency.Settlement{}, fmt.Errorf("payments: no settlement for a key of %s %s", k.Method, k.Path)
	}
	pctx, cancel := context.WithTimeout(ctx, a.processorTimeout)
	defer cancel()
	charge, err := a.processor.find(pctx, chargeKey(k.ClientID, k.OperationID))
	switch {
	case errors.Is(err, errNoCharge):
		return idempotency.Settlement{Release: true}, nil
	case err != nil:
		return idempotency.Settlement{}, fmt.Errorf("payments: looking for the operation's charge: %w", err)
	case charge.Customer == "":
		// A charge made by an earlier server, which did not send it.
		return idempotency.Settlement{}, fmt.Errorf("payments: charge %s does not name its customer; settle it by hand", charge.ID)
	}
	p := Payment{
		ID:             paymentID(k.ClientID, k.OperationID),
		ClientID:       k.ClientID,
		Customer:       charge.Customer,
		Amount:         charge.Amount,
		Currency:       charge.Currency,
		IdempotencyKey: k.Key,
		OperationID:    k.OperationID,
		ChargeID:       charge.ID,
		CreatedAt:      time.Now().UTC().Truncate(time.Microsecond),
	}
	if err := a.store.CreatePayment(ctx, p); err != nil {
		return idempotency.Settlement{}, fmt.Errorf("payments: storing the payment of charge %s: %w", charge.ID, err)
	}
	a.log.Info("payments: an abandoned payment was settled from its charge", "client", k.ClientID, "key", k.Key,
		"operation", k.OperationID, "charge", charge.ID, "payment", p.ID)
	return idempotency.Settlement{Response: &idempotency.StoredResponse{
		Status:      http.StatusCreated,
		ContentType: "application/json",
		Header:      map[string]string{"Location": "/v1/payments/" + p.ID},
		Body:        encodeJSON(resource(p)),
	}}, nil
}
