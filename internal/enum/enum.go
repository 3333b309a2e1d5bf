// Package enum names the values of the small enumerations (constants
// counted by iota from 0) of the other packages, from one table of names
// each.
package enum

import "fmt"

// Integer is the underlying type of an enumeration.
type Integer interface {
	~int | ~int8 | ~int16 | ~int32 | ~int64 | ~uint | ~uint8 | ~uint16 | ~uint32 | ~uint64
}

// String returns names[v], or "typ(v)" for a value the table does not name.
func String[T Integer](v T, typ string, names ...string) string {
	if v >= 0 && uint64(v) < uint64(len(names)) {
		return names[v]
	}
	return fmt.Sprintf("%s(%d)", typ, int64(v))
}
