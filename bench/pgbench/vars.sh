# The pgbench variables of the generated scripts (first.sql,
# unkeyed.sql): the values the server sends for a demo payment (see
# server/postgres.go); fp is a SHA-256, as bytea hex input. Sourced by
# pgbench/run.sh, which passes "${pgbench_vars[@]}".
pgbench_vars=(
	-D client=pgbench -D method=POST -D path=/v1/payments
	-D 'fp=\x9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08'
	-D lockus=30000000 -D retus=86400000000
	-D status=201 -D ctype=application/json
	-D 'hdr={"Location": "/v1/payments/pay_b5ad45db40c10415a7d143db"}'
	-D 'body={"id":"pay_b5ad45db40c10415a7d143db","object":"payment","amount":4200,"currency":"usd","customer":"cus_123","charge":"ch_0d1c8f4f8e2b4a6f9c3d2e1f0a9b8c7d","created":"2026-01-01T00:00:00Z"}'
	-D customer=cus_123 -D currency=usd
)
