package fenced_test

import (
	"testing"

	"github.com/leaderelect/leader/internal/fenced"
)

// Hand-made histories of one resource, with small integers as times.

func write(client string, term uint64, value string, accepted bool, invoke, ret int64) fenced.Op {
	return fenced.Op{Kind: fenced.Write, Resource: "r", Client: client, Term: term, Value: value, Accepted: accepted, Invoke: invoke, Return: ret}
}

func read(term uint64, value string, invoke, ret int64) fenced.Op {
	return fenced.Op{Kind: fenced.Read, Resource: "r", Client: "reader", Term: term, Value: value, Invoke: invoke, Return: ret}
}

func unknown(op fenced.Op) fenced.Op {
	op.Unknown, op.Accepted, op.Return, op.Err = true, false, 0, "connection reset"
	return op
}

func TestCheckLinearizable(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		what string
		ops  []fenced.Op
		ok   bool
	}{
		{"writes with growing terms, then a read of the last, pass", []fenced.Op{
			write("a", 1, "x", true, 0, 10),
			write("b", 2, "y", true, 20, 30),
			write("b", 2, "z", true, 40, 50),
			read(2, "z", 60, 70),
		}, true},
		{"a write refused after a greater term passes", []fenced.Op{
			write("a", 5, "x", true, 0, 10),
			write("b", 3, "y", false, 20, 30),
			read(5, "x", 40, 50),
		}, true},
		{"overlapping writes may take effect in either order", []fenced.Op{
			write("a", 5, "x", true, 0, 10),
			write("b", 3, "y", true, 5, 15), // before a's, in the order that works
			read(5, "x", 20, 30),
		}, true},
		{"a write accepted with a smaller term after a greater one completed fails", []fenced.Op{
			write("a", 5, "x", true, 0, 10),
			write("b", 3, "y", true, 20, 30),
		}, false},
		{"a write refused though its term was the greatest fails", []fenced.Op{
			write("a", 5, "x", true, 0, 10),
			write("b", 6, "y", false, 20, 30),
		}, false},
		{"the first write refused fails", []fenced.Op{
			write("a", 1, "x", false, 0, 10),
		}, false},
		{"a read of a value never written fails", []fenced.Op{
			write("a", 1, "x", true, 0, 10),
			read(1, "w", 20, 30),
		}, false},
		{"a read of an old value after a newer write completed fails", []fenced.Op{
			write("a", 1, "x", true, 0, 10),
			write("b", 2, "y", true, 20, 30),
			read(1, "x", 40, 50),
		}, false},
		{"a read of a refused write's value fails", []fenced.Op{
			write("a", 5, "x", true, 0, 10),
			write("b", 3, "y", false, 20, 30),
			read(3, "y", 40, 50),
		}, false},
		{"a write of unknown outcome may have taken effect", []fenced.Op{
			write("a", 1, "x", true, 0, 10),
			unknown(write("b", 2, "y", false, 20, 30)),
			read(2, "y", 100, 110),
		}, true},
		{"a write of unknown outcome may not have taken effect", []fenced.Op{
			write("a", 1, "x", true, 0, 10),
			unknown(write("b", 2, "y", false, 20, 30)),
			read(1, "x", 100, 110),
		}, true},
		{"a write of unknown outcome takes effect at most once", []fenced.Op{
			write("a", 1, "x", true, 0, 10),
			unknown(write("b", 2, "y", false, 20, 30)),
			read(2, "y", 100, 110),
			read(1, "x", 120, 130),
		}, false},
		{"a stale write of unknown outcome cannot have taken effect", []fenced.Op{
			write("a", 5, "x", true, 0, 10),
			unknown(write("b", 3, "y", false, 20, 30)),
			read(3, "y", 100, 110),
		}, false},
		{"a read that failed constrains nothing", []fenced.Op{
			write("a", 1, "x", true, 0, 10),
			unknown(read(7, "nonsense", 20, 30)),
		}, true},
	} {
		t.Run(tc.what, func(t *testing.T) {
			t.Parallel()
			ok, _ := fenced.CheckLinearizable(tc.ops)
			if ok != tc.ok {
				t.Errorf("CheckLinearizable = %v, want %v", ok, tc.ok)
			}
		})
	}

	t.Run("resources are checked independently", func(t *testing.T) {
		t.Parallel()
		other := write("b", 1, "y", true, 20, 30)
		other.Resource = "other"
		ops := []fenced.Op{write("a", 5, "x", true, 0, 10), other}
		if ok, _ := fenced.CheckLinearizable(ops); !ok {
			t.Errorf("a term-1 write to another resource after a term-5 write failed")
		}
	})
}
