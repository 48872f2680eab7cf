-- Schema version 2 of the reference payments server's own tables: the
-- customer of each charge, as a real processor keeps it, so that the
-- sweeper can write the payment of an abandoned operation from its charge
-- alone. NULL for the charges made before.
ALTER TABLE charges ADD COLUMN IF NOT EXISTS customer_id text;
