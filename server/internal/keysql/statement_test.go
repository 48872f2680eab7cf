package keysql

import "testing"

// The refusals of Scan that are not a statement's own word.
const (
	bodyRefused = "a CREATE whose body holds statements (BEGIN ATOMIC, a rule's actions); run it outside the request"
	scsRefused  = "SQL that names standard_conforming_strings"
)

// scanCases are the statements Scan reads, with what it must find; they
// seed FuzzScanSQL too.
var scanCases = []struct {
	sql     string
	control string
	set     bool
}{
	// Statements that end the transaction, however written.
	{"COMMIT", "COMMIT", false},
	{"commit work", "COMMIT", false},
	{"  \n\tCommit;", "COMMIT", false},
	{"END", "END", false},
	{"end transaction", "END", false},
	{"ABORT", "ABORT", false},
	{"ROLLBACK", "ROLLBACK", false},
	{"rollback and chain", "ROLLBACK", false},
	{"COMMIT AND CHAIN", "COMMIT", false},
	{"ROLLBACK WORK", "ROLLBACK", false},
	{"PREPARE TRANSACTION 'x'", "PREPARE TRANSACTION", false},
	{"prepare\ntransaction 'x'", "PREPARE TRANSACTION", false},
	{"COMMIT PREPARED 'x'", "COMMIT", false},
	{"ROLLBACK PREPARED 'x'", "ROLLBACK", false},
	{"/* a /* nested */ comment */ COMMIT", "COMMIT", false},
	{"-- a line comment\nROLLBACK", "ROLLBACK", false},
	{"INSERT INTO t VALUES (1); COMMIT", "COMMIT", false},
	{"INSERT INTO t VALUES (1);COMMIT;INSERT INTO t VALUES (2)", "COMMIT", false},
	{"SELECT ';'; SELECT $$;$$; SELECT $tag$ ; $$ ; $tag$; rollback", "ROLLBACK", false},
	{`SELECT E'\';' ; END`, "END", false},
	{`SELECT "a;""b" FROM t; ABORT`, "ABORT", false},
	{"SET LOCAL x = 1; COMMIT", "COMMIT", true},

	// Statements that stay inside the transaction.
	{"ROLLBACK TO SAVEPOINT s", "", false},
	{"rollback to s", "", false},
	{"ROLLBACK WORK TO SAVEPOINT s", "", false},
	{"rollback transaction to s", "", false},
	{"SAVEPOINT s", "", false},
	{"RELEASE SAVEPOINT s", "", false},
	{"BEGIN", "", false},
	{"START TRANSACTION", "", false},
	{"PREPARE p AS SELECT 1", "", false},
	{"SELECT 1", "", false},
	{"", "", false},
	{";;", "", false},
	{"INSERT INTO t (c) VALUES ('commit')", "", false},
	{"INSERT INTO t (c) VALUES ('x; COMMIT')", "", false},
	{"INSERT INTO t (c) VALUES ('it''s; commit')", "", false},
	{`INSERT INTO t (c) VALUES (E'it\'s; commit')`, "", false},
	{"INSERT INTO t (c) VALUES ($$; commit$$)", "", false},
	{"INSERT INTO t (c) VALUES ($body$; commit; $$ $body$)", "", false},
	{"SELECT a$b; SELECT 1", "", false},
	{"SELECT $1; SELECT $2", "", false},
	{`SELECT 1 AS "x; commit"`, "", false},
	{"SELECT 1 -- ; commit\n", "", false},
	{"SELECT 1 /* ; commit */", "", false},
	{"UPDATE t SET x = CASE WHEN y THEN 1 END; SELECT 1", "", false},
	{"SELECT 'unterminated; COMMIT", "", false},
	{"SELECT $$unterminated; COMMIT", "", false},
	{"/* unterminated; COMMIT", "", false},
	// A CREATE whose body holds statements is refused: its semicolons and
	// END cannot be told from the text's own.
	{"CREATE FUNCTION f() RETURNS int LANGUAGE sql BEGIN ATOMIC SELECT 1; END", bodyRefused, false},
	{"CREATE RULE r AS ON INSERT TO t DO ALSO (INSERT INTO u VALUES (1); COMMIT)", bodyRefused, false},
	{"create or replace rule r as on insert to t do nothing", bodyRefused, false},
	// Any other CREATE is read past (a review hid a COMMIT after one).
	{"CREATE TEMP TABLE IF NOT EXISTS t (a int); COMMIT", "COMMIT", false},
	{"CREATE FUNCTION f() RETURNS int LANGUAGE sql AS $$ SELECT 1; $$; SELECT 1", "", false},
	{"CREATE TABLE atomic_begin (rule int); SELECT 1", "", false},
	// standard_conforming_strings off makes PostgreSQL read 'a\'' as one
	// string where Scan reads two (a review hid a COMMIT so).
	{"SELECT set_config('standard_conforming_strings', 'off', true)", scsRefused, false},
	{"SET standard_conforming_strings = off", scsRefused, false},

	// SET, which may change the isolation level.
	{"SET TRANSACTION ISOLATION LEVEL SERIALIZABLE", "", true},
	{"set local transaction_isolation = 'serializable'", "", true},
	{"SELECT 1; SET x = 1", "", true},
	{"SELECT 'SET'", "", false},
	{"RESET ALL", "", false},
}

func TestScanSQL(t *testing.T) {
	for _, tt := range scanCases {
		got := Scan(tt.sql)
		if got.Control != tt.control || got.Set != tt.set {
			t.Errorf("Scan(%q) = %+v, want control %q, set %v", tt.sql, got, tt.control, tt.set)
		}
	}
}

// FuzzScanSQL checks that Scan ends on any text, and that what follows
// a statement that ends the transaction cannot hide it.
func FuzzScanSQL(f *testing.F) {
	for _, tt := range scanCases {
		f.Add(tt.sql, "SELECT 1")
	}
	f.Fuzz(func(t *testing.T, sql, more string) {
		if Scan(sql).Control != "" && Scan(sql+"\n;"+more).Control == "" {
			t.Errorf("Scan(%q) finds a transaction control statement, but not once followed by %q", sql, more)
		}
	})
}
