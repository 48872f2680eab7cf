package docscheck

import (
	"bytes"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// quickStartImports are the packages the README's Go blocks may name, by
// the name they use.
var quickStartImports = map[string]string{
	"context":     "context",
	"errors":      "errors",
	"fmt":         "fmt",
	"http":        "net/http",
	"json":        "encoding/json",
	"log":         "log",
	"os":          "os",
	"strings":     "strings",
	"time":        "time",
	"idem":        "github.com/idemkit/idem",
	"idempotency": "github.com/idemkit/idem/server/idempotency",
	"pgstore":     "github.com/idemkit/idem/server/pgstore",
	"sqlstore":    "github.com/idemkit/idem/server/sqlstore",
	"pgxpool":     "github.com/jackc/pgx/v5/pgxpool",
}

// quickStartFree are the variables the README's statement blocks use
// without declaring them: what the reader's code around them has.
const quickStartFree = `
var (
	ctx     context.Context
	token   string
	payment string
	client  *http.Client
)
`

var goBlock = regexp.MustCompile("(?s)```go\n(.*?)```")

// TestREADMEQuickStartsCompile builds the README's Go blocks as one
// package, as a reader would paste them: declarations as they are, and
// each block of statements as the body of a function of its own, with the
// few variables the text around them names (ctx, token, payment, client).
func TestREADMEQuickStartsCompile(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a package: not with -short")
	}
	var src bytes.Buffer
	blocks := goBlock.FindAllStringSubmatch(read(t, "README.md"), -1)
	require.NotEmpty(t, blocks, "README.md has no Go block")
	for i, b := range blocks {
		code := b[1]
		if _, err := parser.ParseFile(token.NewFileSet(), "", "package p\n"+code, 0); err == nil {
			fmt.Fprintf(&src, "// README block %d\n%s\n", i+1, code)
			continue
		}
		used, err := declared(code)
		require.NoError(t, err, "README block %d is neither declarations nor statements", i+1)
		fmt.Fprintf(&src, "// README block %d\nfunc block%d() {\n%s\n", i+1, i+1, code)
		for _, name := range used {
			fmt.Fprintf(&src, "\t_ = %s\n", name)
		}
		src.WriteString("}\n\n")
	}
	body := quickStartFree + src.String()
	var file bytes.Buffer
	file.WriteString("package readme\n\nimport (\n")
	names := make([]string, 0, len(quickStartImports))
	for name := range quickStartImports {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		if strings.Contains(body, name+".") {
			fmt.Fprintf(&file, "\t%s %q\n", name, quickStartImports[name])
		}
	}
	file.WriteString(")\n" + body)

	// Inside the module, so that its packages resolve; the leading
	// underscore keeps it out of ./... should a run be cut short.
	dir, err := os.MkdirTemp(".", "_readme")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	require.NoError(t, os.WriteFile(filepath.Join(dir, "readme.go"), file.Bytes(), 0o644))
	out, err := exec.Command("go", "vet", "./"+dir).CombinedOutput()
	if err != nil {
		t.Fatalf("the README's Go blocks do not build: %v\n%s\n--- as built:\n%s", err, out, file.String())
	}
}

// declared returns the names that code, a list of statements, declares
// with := at its top level, which a function of it must use.
func declared(code string) ([]string, error) {
	f, err := parser.ParseFile(token.NewFileSet(), "", "package p\nfunc _() {\n"+code+"\n}", 0)
	if err != nil {
		return nil, err
	}
	var names []string
	for _, st := range f.Decls[0].(*ast.FuncDecl).Body.List {
		if as, ok := st.(*ast.AssignStmt); ok && as.Tok == token.DEFINE {
			for _, lhs := range as.Lhs {
				if id, ok := lhs.(*ast.Ident); ok && id.Name != "_" && !slices.Contains(names, id.Name) {
					names = append(names, id.Name)
				}
			}
		}
	}
	return names, nil
}
