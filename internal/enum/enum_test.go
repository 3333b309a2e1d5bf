package enum

import "testing"

func TestString(t *testing.T) {
	type color uint8
	type signed int
	for _, c := range []struct{ got, want string }{
		{String(color(0), "color", "red", "green"), "red"},
		{String(color(1), "color", "red", "green"), "green"},
		{String(color(2), "color", "red", "green"), "color(2)"},
		{String(signed(-1), "pkg.signed", "a"), "pkg.signed(-1)"},
	} {
		if c.got != c.want {
			t.Errorf("got %q, want %q", c.got, c.want)
		}
	}
}
