package bench

import (
	"flag"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite pgbench/*.sql from the SQL of ../server and of the key store (../server/internal/keysql)")

// sqlSources are the Go files whose SQL the scripts run: the key store's
// statements (keysql, the one source of pgstore's and sqlstore's), and the
// reference server's payment and charge.
var sqlSources = []string{"../server/postgres.go", "../server/internal/keysql/*.go"}

// TestPgbenchScripts checks that pgbench/first.sql still runs the
// statements of one first execution
// of the reference server, as server/postgres.go and server/pgstore have
// them, with the substitutions listed in pgbenchHeader, and
// pgbench/unkeyed.sql those of an unkeyed one. Run with -update to rewrite
// them.
func TestPgbenchScripts(t *testing.T) {
	src, err := goConsts(sqlSources...)
	if err != nil {
		t.Fatalf("reading the server's SQL (run from bench/ in the idem repository): %v", err)
	}
	for _, name := range []string{"pgbench/first.sql"} {
		want, err := pgbenchScript(src)
		if err != nil {
			t.Fatal(err)
		}
		if *update {
			if err := os.WriteFile(name, []byte(want), 0o644); err != nil {
				t.Fatal(err)
			}
			continue
		}
		got, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		if string(got) != want {
			t.Errorf("%s is not the server's SQL any more; run go test -run TestPgbenchScripts -update", name)
		}
	}
	want, err := pgbenchUnkeyedScript(src)
	if err != nil {
		t.Fatal(err)
	}
	const name = "pgbench/unkeyed.sql"
	if *update {
		if err := os.WriteFile(name, []byte(want), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	if got, err := os.ReadFile(name); err != nil {
		t.Fatal(err)
	} else if string(got) != want {
		t.Errorf("%s is not the server's SQL any more; run go test -run TestPgbenchScripts -update", name)
	}
}

const pgbenchHeader = `-- One first execution of POST /v1/payments on the reference server on
-- PostgreSQL, as pgbench runs it: claim the key (pgstore), insert the card
-- processor's charge, then in one transaction insert the payment (the
-- handler's write through pgstore.Tx) and complete the key
-- (pgstore's completion, sent with the COMMIT). GENERATED from
-- server/postgres.go and server/pgstore by bench/pgbench_test.go (go test
-- -run TestPgbenchScripts -update); do not edit.
--
-- The statements are the server's, with its $n parameters as pgbench
-- variables, and these changes, which pgbench needs and which leave the
-- plans alone: an unnamed result column of the charge is
-- named (\gset needs names); the charge's $1 is '' and $5 NULL, and the
-- payment's created_at NULL, as the server sends them. pgbench runs BEGIN,
-- the transaction's ID, the INSERT, the completion and COMMIT as five
-- round trips; the server pipelines BEGIN with the transaction's ID, and
-- the completion with the COMMIT (three, with the INSERT): the same WAL
-- flushes.
--
-- Variables (-D, see bench/pgbench/run.sh): client method path fp lockus
-- retus status ctype hdr body customer currency.
`

// pgbenchScript builds a pgbench script from the server's SQL constants.
func pgbenchScript(src map[string]string) (string, error) {
	// claimInsertSQL: what pgstore's Claim runs first, and all that a new
	// key needs (claimReadSQL follows only for a key that has a row).
	claim, err := goConst(src, "ClaimInsertSQL")
	if err != nil {
		return "", err
	}
	charge, err := goConst(src, "createChargeSQL")
	if err != nil {
		return "", err
	}
	insert, err := goConst(src, "insertPaymentSQL")
	if err != nil {
		return "", err
	}
	complete, err := goConst(src, "CompleteInTxSQL")
	if err != nil {
		return "", err
	}
	txid, err := goConst(src, "TxIDSQL")
	if err != nil {
		return "", err
	}
	claim, err = params(claim, map[int]string{
		1: ":client", 2: ":key", 3: ":method", 4: ":path", 5: ":fp", 6: ":lockus", 7: ":retus",
		8: "md5(:key::text)::uuid", 9: ":key", // the operation ID and the token the store gives
	})
	if err != nil {
		return "", fmt.Errorf("claimInsertSQL: %w", err)
	}
	if charge, err = pgbenchCharge(charge); err != nil {
		return "", err
	}
	if insert, err = params(insert, map[int]string{
		1: "'pay_' || :key", 2: ":client", 3: ":customer", 4: ":amount", 5: ":currency",
		6: ":key", 7: "md5(:key::text)", 8: ":ch_charge_id", 9: "NULL::timestamptz",
	}); err != nil {
		return "", fmt.Errorf("insertPaymentSQL: %w", err)
	}
	complete, err = params(complete, map[int]string{
		1: ":client", 2: ":key", 3: ":key", 4: ":status", 5: ":ctype", 6: ":hdr", 7: ":body",
		8: "(:xid)::text",
	})
	if err != nil {
		return "", fmt.Errorf("completeInTxSQL: %w", err)
	}
	var b strings.Builder
	b.WriteString(pgbenchHeader)
	b.WriteString("\n\\set key random(1, 9000000000000000000)\n\\set amount random(100, 100000)\n\n")
	b.WriteString("-- claimInsertSQL\n" + strings.TrimSpace(claim) + ";\n")
	b.WriteString("\n-- createChargeSQL (the fake card processor)\n" + strings.TrimSpace(charge) + "\n\\gset ch_\n")
	b.WriteString("\nBEGIN;\n-- txIDSQL (pgstore reads the transaction's ID and level with the BEGIN)\n" + strings.TrimSpace(txid) + "\n\\gset\n")
	b.WriteString("-- insertPaymentSQL (the handler's write)\n" + strings.TrimSpace(insert) + ";\n")
	b.WriteString("-- completeInTxSQL (the key's completion, checked to run in the transaction begun)\n" + strings.TrimSpace(complete) + ";\nCOMMIT;\n")
	return b.String(), nil
}

const pgbenchUnkeyedHeader = `-- One unkeyed POST /v1/payments of the reference server started with
-- -no-idempotency, as pgbench runs it: insert the card processor's charge,
-- then insert the payment in a transaction of its own (BEGIN, INSERT,
-- COMMIT, as PostgresStorage.CreatePayment does outside a keyed request).
-- The database's side of the load test's "unkeyed" scenario (c), to set
-- against first.sql (a). GENERATED from server/postgres.go by
-- bench/pgbench_test.go (go test -run TestPgbenchScripts -update); do not
-- edit.
--
-- The same substitutions as first.sql; the payment's id, key and operation
-- are what the server derives from a fresh random operation ID: here the
-- random :key, '' (no key) and gen_random_uuid()::text.
`

// pgbenchUnkeyedScript builds pgbench/unkeyed.sql from the server's SQL.
func pgbenchUnkeyedScript(src map[string]string) (string, error) {
	charge, err := goConst(src, "createChargeSQL")
	if err != nil {
		return "", err
	}
	insert, err := goConst(src, "insertPaymentSQL")
	if err != nil {
		return "", err
	}
	if charge, err = pgbenchCharge(charge); err != nil {
		return "", err
	}
	if insert, err = params(insert, map[int]string{
		1: "'pay_' || :key", 2: ":client", 3: ":customer", 4: ":amount", 5: ":currency",
		6: "''", 7: "gen_random_uuid()::text", 8: ":ch_charge_id", 9: "NULL::timestamptz",
	}); err != nil {
		return "", fmt.Errorf("insertPaymentSQL: %w", err)
	}
	return pgbenchUnkeyedHeader +
		"\n\\set key random(1, 9000000000000000000)\n\\set amount random(100, 100000)\n\n" +
		"-- createChargeSQL (the fake card processor)\n" + strings.TrimSpace(charge) + "\n\\gset ch_\n" +
		"\nBEGIN;\n-- insertPaymentSQL\n" + strings.TrimSpace(insert) + ";\nCOMMIT;\n", nil
}

// pgbenchCharge turns createChargeSQL into pgbench's form, as both scripts
// run it: the created column named for \gset, $1 the empty string and $5 NULL as the
// server sends them.
func pgbenchCharge(charge string) (string, error) {
	const createdCol = "created_at, true FROM inserted"
	if !strings.Contains(charge, createdCol) {
		return "", fmt.Errorf("createChargeSQL has no %q any more; update pgbenchCharge", createdCol)
	}
	charge = strings.Replace(charge, createdCol, "created_at, true AS created FROM inserted", 1)
	charge, err := params(charge, map[int]string{
		1: "''", 2: ":key", 3: ":amount", 4: ":currency", 5: "NULL::timestamptz", 6: ":customer",
	})
	if err != nil {
		return "", fmt.Errorf("createChargeSQL: %w", err)
	}
	return charge, nil
}

// goConst returns the string constant name of src (see goConsts).
func goConst(src map[string]string, name string) (string, error) {
	v, ok := src[name]
	if !ok {
		return "", fmt.Errorf("no string constant %s in %s", name, strings.Join(sqlSources, ", "))
	}
	return v, nil
}

// goConsts returns the string constants of the Go files that match the
// patterns, by name, with their values as the compiler sees them: string
// literals, and sums of literals and other constants (pgstore builds its
// statements from shared expressions). A constant of another form is left
// out. Names are taken as unique across the files.
func goConsts(patterns ...string) (map[string]string, error) {
	exprs := make(map[string]ast.Expr)
	fset := token.NewFileSet()
	for _, pattern := range patterns {
		files, err := filepath.Glob(pattern)
		if err != nil || len(files) == 0 {
			return nil, fmt.Errorf("no file matches %s", pattern)
		}
		for _, file := range files {
			if strings.HasSuffix(file, "_test.go") {
				continue
			}
			f, err := parser.ParseFile(fset, file, nil, parser.SkipObjectResolution)
			if err != nil {
				return nil, err
			}
			for _, decl := range f.Decls {
				gd, ok := decl.(*ast.GenDecl)
				if !ok || gd.Tok != token.CONST {
					continue
				}
				for _, spec := range gd.Specs {
					vs := spec.(*ast.ValueSpec)
					for i, name := range vs.Names {
						if i < len(vs.Values) {
							exprs[name.Name] = vs.Values[i]
						}
					}
				}
			}
		}
	}
	var eval func(e ast.Expr, depth int) (string, bool)
	eval = func(e ast.Expr, depth int) (string, bool) {
		if depth > 50 {
			return "", false
		}
		switch e := e.(type) {
		case *ast.BasicLit:
			if e.Kind != token.STRING {
				return "", false
			}
			s, err := strconv.Unquote(e.Value)
			return s, err == nil
		case *ast.ParenExpr:
			return eval(e.X, depth+1)
		case *ast.Ident:
			x, ok := exprs[e.Name]
			if !ok {
				return "", false
			}
			return eval(x, depth+1)
		case *ast.BinaryExpr:
			if e.Op != token.ADD {
				return "", false
			}
			l, ok := eval(e.X, depth+1)
			if !ok {
				return "", false
			}
			r, ok := eval(e.Y, depth+1)
			return l + r, ok
		}
		return "", false
	}
	consts := make(map[string]string)
	for name, e := range exprs {
		if v, ok := eval(e, 0); ok {
			consts[name] = v
		}
	}
	return consts, nil
}

var paramRE = regexp.MustCompile(`\$(\d+)`)

// params replaces the $n parameters of sql with vars[n]; every parameter
// must have one.
func params(sql string, vars map[int]string) (string, error) {
	var missing error
	out := paramRE.ReplaceAllStringFunc(sql, func(p string) string {
		var n int
		fmt.Sscan(p[1:], &n)
		v, ok := vars[n]
		if !ok {
			missing = fmt.Errorf("parameter %s has no pgbench variable", p)
		}
		return v
	})
	return out, missing
}
