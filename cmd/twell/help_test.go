package main

import (
	"bytes"
	"strings"
	"testing"
)

// TestEveryCommandHelpAndBadFlag runs every command with -h (help on
// stdout, exit 0) and with an unknown flag (one line on stderr naming it,
// exit 2, no stack trace).
func TestEveryCommandHelpAndBadFlag(t *testing.T) {
	for _, name := range sortedNames() {
		args := strings.Fields(name)
		t.Run(name, func(t *testing.T) {
			var out, errb bytes.Buffer
			if code := run(append(args, "-h"), &out, &errb); code != 0 {
				t.Fatalf("-h: exit %d, stderr %q", code, errb.String())
			}
			help := out.String()
			if !strings.HasPrefix(help, "usage: twell "+name) || !strings.Contains(help, commands[name].summary[1:]) {
				t.Errorf("-h printed %q, want a usage line and the summary", help)
			}
			out.Reset()
			if code := run(append([]string{"help"}, args...), &out, &errb); code != 0 || out.String() != help {
				t.Errorf("twell help %s: exit %d, output differs from -h", name, code)
			}
			out.Reset()
			errb.Reset()
			code := run(append(args, "-no-such-flag"), &out, &errb)
			msg := errb.String()
			if code != 2 || strings.Count(msg, "\n") != 1 || !strings.Contains(msg, "no-such-flag") || strings.Contains(msg, "goroutine") {
				t.Errorf("bad flag: exit %d, stderr %q; want exit 2 and one line naming the flag", code, msg)
			}
		})
	}
}

func TestGroupsAndTopLevelHelp(t *testing.T) {
	for _, k := range []struct {
		args []string
		code int
		want string
	}{
		{nil, 0, "commands:"},
		{[]string{"help"}, 0, "twell help <command>"},
		{[]string{"bench", "-h"}, 0, "bench ffn"},
		{[]string{"tokenizer", "--help"}, 0, "tokenizer encode"},
		{[]string{"bench"}, 2, "bench model"},
		{[]string{"tokenizer"}, 2, "tokenizer train"},
	} {
		var out, errb bytes.Buffer
		code := run(k.args, &out, &errb)
		if code != k.code || !strings.Contains(out.String(), k.want) {
			t.Errorf("twell %v: exit %d, stdout %q; want exit %d and %q", k.args, code, out.String(), k.code, k.want)
		}
	}
	var out, errb bytes.Buffer
	if code := run([]string{"frobnicate"}, &out, &errb); code != 2 || !strings.Contains(errb.String(), `unknown command "frobnicate"`) {
		t.Errorf("unknown command: exit %d, %q", code, errb.String())
	}
}

func TestVersion(t *testing.T) {
	var out, errb bytes.Buffer
	if code := run([]string{"version"}, &out, &errb); code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	for _, want := range []string{"twell " + version, "go go1.", "commit "} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("version output %q lacks %q", out.String(), want)
		}
	}
}
