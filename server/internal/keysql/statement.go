package keysql

import (
	"cmp"
	"strings"
)

// Facts is what a store's unit of work needs to know of a handler's SQL
// before sending it: whether one of its statements would end the request's
// transaction, and whether one is a SET (which may change the
// transaction's isolation level).
type Facts struct {
	Control string // the first statement that ends a transaction block ("COMMIT", "ROLLBACK", ...); "" if none
	Set     bool   // a statement begins with SET
}

// Scan splits sql into its top-level statements, as PostgreSQL's lexer
// does (quoted strings, escape strings, dollar quotes, quoted identifiers,
// line and nested block comments), and reads the leading keywords of each.
//
// Strings are read as PostgreSQL reads them with standard_conforming_strings
// on (its default, and what pgx requires of the simple protocol): a
// backslash escapes only in E'...'.
//
// It is a guard, not a parser: it recognises the statements that end a
// transaction block (COMMIT, END, ROLLBACK other than ROLLBACK TO, ABORT,
// PREPARE TRANSACTION, COMMIT PREPARED, ROLLBACK PREPARED) and those that
// begin one (BEGIN, START TRANSACTION), each only as the first word of a
// statement, where PostgreSQL reads them. A CREATE whose body holds
// statements of its own (BEGIN ATOMIC ... END, a rule's actions), whose
// semicolons and END it cannot tell from the text's, is refused, as is any
// text that names standard_conforming_strings, which changes how strings
// are read. pgstore's unit of work also checks the connection's
// transaction status after each statement; sqlstore, on database/sql,
// cannot.
func Scan(sql string) Facts {
	var f Facts
	if strings.Contains(strings.ToLower(sql), "standard_conforming_strings") {
		// Turned off, it changes how PostgreSQL reads every later string
		// (a backslash escapes), and Scan would read them otherwise.
		f.Control = "SQL that names standard_conforming_strings"
		return f
	}
	for s := sql; s != ""; {
		var words [3]string
		var rest string
		words, rest = leadingWords(s)
		switch words[0] {
		case "CREATE":
			if bodyHoldsStatements(rest[:len(rest)-len(skipStatement(rest))]) {
				// Its body's semicolons and END are not read as PostgreSQL
				// reads them, so nothing after it could be trusted.
				f.Control = "a CREATE whose body holds statements (BEGIN ATOMIC, a rule's actions); run it outside the request"
				return f
			}
		case "SET":
			f.Set = true
		case "COMMIT", "END", "ABORT":
			f.Control = cmp.Or(f.Control, words[0])
		case "ROLLBACK":
			next := words[1]
			if next == "WORK" || next == "TRANSACTION" {
				next = words[2]
			}
			if next != "TO" { // ROLLBACK TO SAVEPOINT stays inside the transaction
				f.Control = cmp.Or(f.Control, words[0])
			}
		case "PREPARE":
			if words[1] == "TRANSACTION" {
				f.Control = cmp.Or(f.Control, "PREPARE TRANSACTION")
			}
		case "BEGIN", "START":
			// A warning inside a transaction block, as with any pgx.Tx,
			// unless the same text also ends it.
		}
		s = skipStatement(rest)
	}
	return f
}

// bodyHoldsStatements reports whether the text of a CREATE statement (after
// the word CREATE, up to its first top-level semicolon) starts a body that
// holds statements of its own: a SQL-standard function body (BEGIN
// ATOMIC), or a rule (whose actions may be a list in parentheses).
func bodyHoldsStatements(stmt string) bool {
	fields := strings.FieldsFunc(strings.ToUpper(stmt), func(r rune) bool {
		return r > 0x7f || !isIdentByte(byte(r))
	})
	if len(fields) > 0 && fields[0] == "RULE" || len(fields) > 2 && fields[0] == "OR" && fields[1] == "REPLACE" && fields[2] == "RULE" {
		return true
	}
	for i := 0; i+1 < len(fields); i++ {
		if fields[i] == "BEGIN" && fields[i+1] == "ATOMIC" {
			return true
		}
	}
	return false
}

// leadingWords returns the first three words of the statement that starts
// s, upper-cased ("" past the last), and s from the first byte after the
// first word.
func leadingWords(s string) (words [3]string, rest string) {
	for i := range words {
		s = skipSpace(s)
		n := 0
		for n < len(s) && isIdentByte(s[n]) {
			n++
		}
		if n == 0 {
			break
		}
		words[i] = strings.ToUpper(s[:n])
		s = s[n:]
		if i == 0 {
			rest = s
		}
	}
	if words[0] == "" {
		rest = s
	}
	return words, rest
}

// skipSpace skips white space and comments.
func skipSpace(s string) string {
	for {
		switch {
		case s == "":
			return s
		case s[0] == ' ' || s[0] == '\t' || s[0] == '\n' || s[0] == '\r' || s[0] == '\f' || s[0] == '\v':
			s = s[1:]
		case strings.HasPrefix(s, "--"):
			s = skipLineComment(s)
		case strings.HasPrefix(s, "/*"):
			s = skipBlockComment(s)
		default:
			return s
		}
	}
}

// skipStatement skips to the byte after the semicolon that ends the
// statement s is inside of, or to the end.
func skipStatement(s string) string {
	for s != "" {
		c := s[0]
		switch {
		case c == ';':
			return s[1:]
		case c == '\'':
			s = skipQuoted(s[1:], '\'', false)
		case c == '"':
			s = skipQuoted(s[1:], '"', false)
		case (c == 'e' || c == 'E') && len(s) > 1 && s[1] == '\'':
			s = skipQuoted(s[2:], '\'', true)
		case c == '$':
			s = skipDollar(s)
		case strings.HasPrefix(s, "--"):
			s = skipLineComment(s)
		case strings.HasPrefix(s, "/*"):
			s = skipBlockComment(s)
		case isIdentByte(c):
			// A whole word: a $ inside it (a$b) starts no dollar quote,
			// and only a word E alone starts an escape string.
			n := 1
			for n < len(s) && (isIdentByte(s[n]) || s[n] == '$') {
				n++
			}
			s = s[n:]
		default:
			s = s[1:]
		}
	}
	return s
}

// skipQuoted skips past the closing quote of a literal or identifier whose
// opening quote is gone; a doubled quote stands for itself, and in an
// escape string (E'...') a backslash escapes the next byte.
func skipQuoted(s string, quote byte, backslash bool) string {
	for i := 0; i < len(s); i++ {
		switch s[i] {
		case '\\':
			if backslash {
				i++
			}
		case quote:
			if i+1 < len(s) && s[i+1] == quote {
				i++
				continue
			}
			return s[i+1:]
		}
	}
	return ""
}

// skipDollar skips a dollar-quoted string ($$...$$, $tag$...$tag$) that
// starts s, or the $ alone (a parameter such as $1).
func skipDollar(s string) string {
	n := 1
	for n < len(s) && isIdentByte(s[n]) {
		n++
	}
	if n == len(s) || s[n] != '$' || (n > 1 && s[1] >= '0' && s[1] <= '9') {
		return s[1:]
	}
	tag := s[:n+1]
	body := s[n+1:]
	if i := strings.Index(body, tag); i >= 0 {
		return body[i+len(tag):]
	}
	return ""
}

// skipLineComment skips a -- comment to the end of its line.
func skipLineComment(s string) string {
	if i := strings.IndexAny(s, "\n\r"); i >= 0 {
		return s[i+1:]
	}
	return ""
}

// skipBlockComment skips a /* */ comment, nested ones included.
func skipBlockComment(s string) string {
	depth := 0
	for i := 0; i+1 < len(s); i++ {
		switch {
		case s[i] == '/' && s[i+1] == '*':
			depth++
			i++
		case s[i] == '*' && s[i+1] == '/':
			depth--
			i++
			if depth == 0 {
				return s[i+1:]
			}
		}
	}
	return ""
}

// isIdentByte reports whether c may be part of an unquoted identifier or
// keyword (bytes of multibyte UTF-8 characters included).
func isIdentByte(c byte) bool {
	return c == '_' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c >= 0x80
}
