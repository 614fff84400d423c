package fenced_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader/internal/fenced"
	"github.com/leaderelect/leader/internal/pgtest"
)

// bundle is what setup gives a test.
type bundle struct {
	pool *pgxpool.Pool
	reg  *fenced.Register
}

// setup creates a fenced table on a fresh database.
func setup(t *testing.T) bundle {
	t.Helper()
	pool := pgtest.NewPool(t)
	reg, err := fenced.Setup(callCtx(t), pool, "fenced")
	if err != nil {
		t.Fatal(err)
	}
	return bundle{pool: pool, reg: reg}
}

// callCtx returns a context for one call, bounded generously.
func callCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func mustWrite(t *testing.T, b bundle, term uint64, writer, value string) bool {
	t.Helper()
	accepted, err := b.reg.Write(callCtx(t), b.pool, "r", term, writer, value)
	if err != nil {
		t.Fatal(err)
	}
	return accepted
}

func mustRead(t *testing.T, b bundle, resource string) (uint64, string) {
	t.Helper()
	term, value, err := b.reg.Read(callCtx(t), b.pool, resource, "test")
	if err != nil {
		t.Fatal(err)
	}
	return term, value
}

// checkLinearizable fails t if ops are not linearizable, saving a
// visualization of why.
func checkLinearizable(t *testing.T, ops []fenced.Op) {
	t.Helper()
	ok, info := fenced.CheckLinearizable(ops)
	if ok {
		return
	}
	path := filepath.Join(t.ArtifactDir(), "linearizability.html")
	if err := porcupine.VisualizePath(fenced.Model(), info, path); err != nil {
		t.Logf("visualizing: %v", err)
	}
	t.Fatalf("the history of %d operations is not linearizable; see %s", len(ops), path)
}

func TestRegister(t *testing.T) {
	t.Parallel()

	t.Run("a write with a smaller term than one accepted is refused", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		if term, value := mustRead(t, b, "r"); term != 0 || value != "" {
			t.Fatalf("a fresh register reads (%d, %q), want (0, \"\")", term, value)
		}
		steps := []struct {
			term     uint64
			value    string
			accepted bool
		}{
			{5, "a", true},
			{3, "stale", false},
			{5, "b", true}, // the same term: the same leader writing again
			{4, "stale", false},
			{6, "c", true},
			{0, "stale", false},
		}
		for _, s := range steps {
			if got := mustWrite(t, b, s.term, "w", s.value); got != s.accepted {
				t.Fatalf("write term %d: accepted = %v, want %v", s.term, got, s.accepted)
			}
		}
		if term, value := mustRead(t, b, "r"); term != 6 || value != "c" {
			t.Fatalf("read (%d, %q), want (6, \"c\")", term, value)
		}
		checkLinearizable(t, b.reg.History())
	})

	t.Run("Setup on an existing table keeps its contents", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		mustWrite(t, b, 3, "w", "kept")
		again, err := fenced.Setup(callCtx(t), b.pool, "fenced")
		if err != nil {
			t.Fatal(err)
		}
		if term, value, err := again.Read(callCtx(t), b.pool, "r", "test"); err != nil || term != 3 || value != "kept" {
			t.Fatalf("read (%d, %q, %v), want (3, \"kept\")", term, value, err)
		}
	})

	t.Run("concurrent writers with various terms leave a linearizable history", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		ctx := callCtx(t)
		const writers, writes, readers, reads = 6, 40, 2, 40
		var wg sync.WaitGroup
		errs := make(chan error, writers+readers)
		for w := range writers {
			wg.Go(func() {
				for i := range writes {
					// Terms mostly grow, with stale ones mixed in.
					term := uint64(i/4 + rand.IntN(4))
					resource := []string{"r", "s"}[rand.IntN(2)]
					if _, err := b.reg.Write(ctx, b.pool, resource, term, fmt.Sprint("w", w), fmt.Sprintf("w%d/%d", w, i)); err != nil {
						errs <- err
						return
					}
				}
			})
		}
		for r := range readers {
			wg.Go(func() {
				for range reads {
					resource := []string{"r", "s"}[rand.IntN(2)]
					if _, _, err := b.reg.Read(ctx, b.pool, resource, fmt.Sprint("reader", r)); err != nil {
						errs <- err
						return
					}
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}

		ops := b.reg.History()
		maxTerm := map[string]uint64{}
		var accepted, refused int
		for _, op := range ops {
			switch {
			case op.Kind != fenced.Write:
			case op.Accepted:
				accepted++
				maxTerm[op.Resource] = max(maxTerm[op.Resource], op.Term)
			default:
				refused++
			}
		}
		if accepted == 0 || refused == 0 {
			t.Fatalf("%d writes accepted and %d refused: want some of each", accepted, refused)
		}
		for _, r := range []string{"r", "s"} {
			if term, _ := mustRead(t, b, r); term != maxTerm[r] {
				t.Errorf("%s: read term %d, want the greatest accepted, %d", r, term, maxTerm[r])
			}
		}
		checkLinearizable(t, b.reg.History())
		t.Logf("%d operations: %d writes accepted, %d refused", len(ops), accepted, refused)
	})

	t.Run("a stale writer is refused while the current one is accepted", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		ctx := callCtx(t)
		if !mustWrite(t, b, 7, "current", "first") {
			t.Fatal("the first write was refused")
		}
		var wg sync.WaitGroup
		results := make(chan string, 40)
		for _, w := range []struct {
			name string
			term uint64
			want bool
		}{{"current", 7, true}, {"stale", 6, false}} {
			wg.Go(func() {
				for i := range 20 {
					accepted, err := b.reg.Write(ctx, b.pool, "r", w.term, w.name, fmt.Sprint(w.name, i))
					if err != nil {
						results <- err.Error()
						return
					}
					if accepted != w.want {
						results <- fmt.Sprintf("%s write %d, term %d: accepted = %v", w.name, i, w.term, accepted)
					}
				}
			})
		}
		wg.Wait()
		close(results)
		for r := range results {
			t.Error(r)
		}
		if term, value := mustRead(t, b, "r"); term != 7 || value != "current19" {
			t.Errorf("read (%d, %q), want (7, \"current19\")", term, value)
		}
		checkLinearizable(t, b.reg.History())
	})

	t.Run("operations logged by several Registers load back and check", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		dir := t.TempDir()
		other, err := fenced.Open("fenced")
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range []*fenced.Register{b.reg, other} {
			if err := r.LogTo(dir); err != nil {
				t.Fatal(err)
			}
		}
		ctx := callCtx(t)
		for i, r := range []*fenced.Register{b.reg, other, b.reg, other} {
			if _, err := r.Write(ctx, b.pool, "r", uint64(i), fmt.Sprint("w", i), fmt.Sprint("v", i)); err != nil {
				t.Fatal(err)
			}
			if _, _, err := r.Read(ctx, b.pool, "r", "reader"); err != nil {
				t.Fatal(err)
			}
		}
		// A write whose process died before it returned: only the line
		// of its invocation.
		pending := `{"id":"dead-1","kind":"write","resource":"r","client":"dead","term":9,"value":"v9","accepted":false,"invoke":1,"return":0,"unknown":true}` + "\n"
		if err := os.WriteFile(filepath.Join(dir, "dead.fenced.jsonl"), []byte(pending+`{"id":"dead-2","ki`), 0o644); err != nil {
			t.Fatal(err)
		}
		for _, r := range []*fenced.Register{b.reg, other} {
			if err := r.Close(); err != nil {
				t.Fatal(err)
			}
		}
		ops, err := fenced.LoadOps(dir)
		if err != nil {
			t.Fatal(err)
		}
		if len(ops) != 9 {
			t.Fatalf("loaded %d operations, want 9:\n%v", len(ops), ops)
		}
		var unknown []fenced.Op
		for _, op := range ops {
			if op.Unknown {
				unknown = append(unknown, op)
			}
		}
		if len(unknown) != 1 || unknown[0].Client != "dead" {
			t.Fatalf("unknown outcomes: %v, want only the dead writer's", unknown)
		}
		checkLinearizable(t, ops)
	})
}
