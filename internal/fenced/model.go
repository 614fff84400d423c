package fenced

import (
	"fmt"
	"math"
	"time"

	"github.com/anishathalye/porcupine"
)

// CheckTimeout bounds CheckLinearizable's search.
const CheckTimeout = time.Minute

// state is one register in the model: the greatest term it has seen and
// its value.
type state struct {
	term  uint64
	value string
}

// input and output are an operation's arguments and result in the model.
type input struct {
	kind     Kind
	resource string
	term     uint64 // a write's
	value    string // a write's
}

type output struct {
	accepted bool   // a write's
	term     uint64 // a read's
	value    string // a read's
	unknown  bool   // a write whose outcome is not known
}

// Model returns the porcupine model of a fenced register, partitioned by
// resource, for CheckLinearizable and for porcupine.Visualize:
//
//   - the state is (greatest term seen, value), initially (0, "");
//   - a write with term >= the greatest term must be accepted, and sets
//     both; a write with a smaller term must be refused, and changes
//     nothing;
//   - a write whose outcome is unknown may have taken effect or not (if
//     its term allowed it);
//   - a read returns the state.
func Model() porcupine.Model {
	nm := porcupine.NondeterministicModel{
		Partition: func(history []porcupine.Operation) [][]porcupine.Operation {
			index := make(map[string]int)
			var parts [][]porcupine.Operation
			for _, op := range history {
				r := op.Input.(input).resource
				i, ok := index[r]
				if !ok {
					i = len(parts)
					index[r] = i
					parts = append(parts, nil)
				}
				parts[i] = append(parts[i], op)
			}
			return parts
		},
		Init: func() []any { return []any{state{}} },
		Step: func(st, in, out any) []any {
			s, i, o := st.(state), in.(input), out.(output)
			switch i.kind {
			case Write:
				allowed := i.term >= s.term
				next := state{term: i.term, value: i.value}
				switch {
				case o.unknown && allowed:
					return []any{s, next}
				case o.unknown:
					return []any{s}
				case allowed && o.accepted:
					return []any{next}
				case !allowed && !o.accepted:
					return []any{s}
				}
			case Read:
				if o.term == s.term && o.value == s.value {
					return []any{s}
				}
			}
			return nil
		},
		DescribeOperation: func(in, out any) string {
			i, o := in.(input), out.(output)
			if i.kind == Read {
				return fmt.Sprintf("read() -> (%d, %q)", o.term, o.value)
			}
			res := "refused"
			switch {
			case o.unknown:
				res = "unknown"
			case o.accepted:
				res = "accepted"
			}
			return fmt.Sprintf("write(%d, %q) -> %s", i.term, i.value, res)
		},
		DescribeState: func(st any) string {
			s := st.(state)
			return fmt.Sprintf("(%d, %q)", s.term, s.value)
		},
	}
	return nm.ToModel()
}

// Operations converts ops to porcupine's form for Model. A write of
// unknown outcome never returns (it may take effect at any time after its
// invocation); a read of unknown outcome constrains nothing and is left
// out. Clients are numbered in order of first appearance.
func Operations(ops []Op) []porcupine.Operation {
	clients := make(map[string]int)
	out := make([]porcupine.Operation, 0, len(ops))
	for _, op := range ops {
		if op.Unknown && op.Kind == Read {
			continue
		}
		id, ok := clients[op.Client]
		if !ok {
			id = len(clients)
			clients[op.Client] = id
		}
		ret := op.Return
		if op.Unknown {
			ret = math.MaxInt64
		}
		out = append(out, porcupine.Operation{
			ClientId: id,
			Input:    input{kind: op.Kind, resource: op.Resource, term: op.Term, value: op.Value},
			Call:     op.Invoke,
			Output:   output{accepted: op.Accepted, term: op.Term, value: op.Value, unknown: op.Unknown},
			Return:   ret,
		})
	}
	return out
}

// CheckLinearizable reports whether ops (from Register.History or LoadOps,
// any order) are a linearizable history of fenced registers (see Model).
// A check that runs out of CheckTimeout reports false. info can be given
// to porcupine.Visualize with Model to see why.
func CheckLinearizable(ops []Op) (ok bool, info porcupine.LinearizationInfo) {
	res, info := porcupine.CheckOperationsVerbose(Model(), Operations(ops), CheckTimeout)
	return res == porcupine.Ok, info
}
