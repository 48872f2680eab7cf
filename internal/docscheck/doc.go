// Package docscheck holds no code: its test checks the repository's
// Markdown (README.md, docs/*.md, BENCHMARKS.md and every other .md file).
// Every relative link must name a file or directory that exists, a
// #fragment must be an anchor GitHub makes from a heading of its target,
// and every page under docs/ must be linked from README.md. Links to other
// sites are not fetched.
package docscheck
