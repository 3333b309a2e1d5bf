// Package testutil holds what the tests of several packages share: one way
// to seed random inputs, the reading of files that other programs (Python,
// Hugging Face) wrote for a test, and the checking of settings read from
// environment variables.
package testutil

import (
	"encoding/json"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"testing"
)

// EnvSeed names the environment variable that replays a seed: a test that
// failed with "random seed N" draws the same inputs under TWELL_TEST_SEED=N.
const EnvSeed = "TWELL_TEST_SEED"

// Rand returns a generator and its seed: TWELL_TEST_SEED when set, a fresh
// seed otherwise. The seed is logged when the test fails, and tests print
// it in their failure messages, so that a failure can be replayed.
func Rand(tb testing.TB) (*rand.Rand, uint64) {
	tb.Helper()
	seed := rand.Uint64()
	if s := os.Getenv(EnvSeed); s != "" {
		var err error
		if seed, err = strconv.ParseUint(s, 10, 64); err != nil {
			tb.Fatalf("%s=%q: %v", EnvSeed, s, err)
		}
	}
	tb.Cleanup(func() {
		if tb.Failed() {
			tb.Logf("random seed %d (rerun with %s=%d)", seed, EnvSeed, seed)
		}
	})
	return rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)), seed
}

// Getenv returns the environment variable name, or skips the test with why
// when it is not set.
func Getenv(tb testing.TB, name, why string) string {
	tb.Helper()
	v := os.Getenv(name)
	if v == "" {
		tb.Skipf("%s not set: %s", name, why)
	}
	return v
}

// ReadJSON decodes the JSON file path into v, failing the test on error.
func ReadJSON(tb testing.TB, path string, v any) {
	tb.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		tb.Fatal(err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		tb.Fatalf("%s: %v", path, err)
	}
}

// WriteJSON writes v as JSON to the file path, failing the test on error.
func WriteJSON(tb testing.TB, path string, v any) {
	tb.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		tb.Fatal(err)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		tb.Fatal(err)
	}
}

// EnvCase is a setting of environment variables and what reading them
// gives: Want, or an error naming the variable Bad.
type EnvCase[T any] struct {
	Env  map[string]string
	Want T
	Bad  string
}

// CheckEnv runs read under each case's variables, the others of vars
// unset, and fails the test where it does not give the case's result.
func CheckEnv[T comparable](t *testing.T, vars []string, read func() (T, error), cases []EnvCase[T]) {
	t.Helper()
	for _, c := range cases {
		for _, name := range vars {
			t.Setenv(name, c.Env[name])
		}
		got, err := read()
		switch {
		case c.Bad != "" && (err == nil || !strings.Contains(err.Error(), c.Bad)):
			t.Errorf("env %v: error %v, want one naming %s", c.Env, err, c.Bad)
		case c.Bad == "" && (err != nil || got != c.Want):
			t.Errorf("env %v: %+v, %v; want %+v", c.Env, got, err, c.Want)
		}
	}
}
