package cupti

import (
	"strconv"
	"strings"
)

// Demangle turns the Itanium C++ names that kernels get into readable ones
// for the forms twell's kernels and most library kernels take: a plain or
// namespace-qualified function name, with template arguments that are
// integer or bool literals or builtin types, e.g.
// "_Z8gemv_actILi1ELb1ELb0EEvPKt..." -> "gemv_act<1, true, false>". The
// parameter list is left out. Template arguments of other forms print as
// "<...>"; a name it cannot read at all (or an extern "C" name) is returned
// as it is.
func Demangle(s string) string {
	if !strings.HasPrefix(s, "_Z") {
		return s
	}
	d := demangler{s: s[2:]}
	out, ok := d.name()
	if !ok {
		return s
	}
	return out
}

// demangler reads s from the front; gaveUp is set once template
// arguments could not be read, after which the rest is not read.
type demangler struct {
	s      string
	gaveUp bool
}

// name reads a possibly nested name and its template arguments.
func (d *demangler) name() (string, bool) {
	if d.eat('N') {
		var parts []string
		for !d.eat('E') && !d.gaveUp {
			part, ok := d.unqualified()
			if !ok {
				return "", false
			}
			parts = append(parts, part)
		}
		if len(parts) == 0 {
			return "", false
		}
		return strings.Join(parts, "::"), true
	}
	return d.unqualified()
}

// unqualified reads <length><identifier> and template arguments after it.
func (d *demangler) unqualified() (string, bool) {
	i := 0
	for i < len(d.s) && d.s[i] >= '0' && d.s[i] <= '9' {
		i++
	}
	if i == 0 {
		return "", false
	}
	n, err := strconv.Atoi(d.s[:i])
	if err != nil || n <= 0 || n > len(d.s)-i {
		return "", false
	}
	id := d.s[i : i+n]
	d.s = d.s[i+n:]
	if d.eat('I') {
		args, ok := d.templateArgs()
		if !ok {
			d.s, d.gaveUp = "", true
			return id + "<...>", true
		}
		id += "<" + strings.Join(args, ", ") + ">"
	}
	return id, true
}

// builtins are the one-letter builtin type codes.
var builtins = map[byte]string{
	'v': "void", 'b': "bool", 'c': "char", 'a': "signed char", 'h': "unsigned char", 's': "short",
	't': "unsigned short", 'i': "int", 'j': "unsigned int", 'l': "long", 'm': "unsigned long",
	'x': "long long", 'y': "unsigned long long", 'f': "float", 'd': "double",
}

// templateArgs reads arguments up to the closing E: literals L<type>[n]<digits>E
// and builtin types.
func (d *demangler) templateArgs() ([]string, bool) {
	var args []string
	for !d.eat('E') {
		if len(d.s) == 0 {
			return nil, false
		}
		c := d.s[0]
		if c != 'L' {
			t, ok := builtins[c]
			if !ok {
				return nil, false
			}
			d.s = d.s[1:]
			args = append(args, t)
			continue
		}
		if len(d.s) < 2 {
			return nil, false
		}
		typ := d.s[1]
		if _, ok := builtins[typ]; !ok || typ == 'v' || typ == 'f' || typ == 'd' {
			return nil, false
		}
		d.s = d.s[2:]
		neg := d.eat('n')
		i := 0
		for i < len(d.s) && d.s[i] >= '0' && d.s[i] <= '9' {
			i++
		}
		if i == 0 || i == len(d.s) || d.s[i] != 'E' {
			return nil, false
		}
		v := d.s[:i]
		d.s = d.s[i+1:]
		switch {
		case typ == 'b' && v == "0":
			v = "false"
		case typ == 'b' && v == "1":
			v = "true"
		case neg:
			v = "-" + v
		}
		args = append(args, v)
	}
	return args, true
}

func (d *demangler) eat(c byte) bool {
	if len(d.s) > 0 && d.s[0] == c {
		d.s = d.s[1:]
		return true
	}
	return false
}
