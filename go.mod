module github.com/idemkit/idem

go 1.25.0

require github.com/dunglas/httpsfv v1.1.2
