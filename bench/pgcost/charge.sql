\set k random(1, 1000000000000)
INSERT INTO charges(charge_id, idempotency_key, amount, currency) VALUES ('ch_'||:k, 'idem_ch_'||:k, 100, 'usd');