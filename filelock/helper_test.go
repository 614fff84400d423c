package filelock_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"testing"
	"time"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/filelock"
)

// The cross-process tests run this test binary again as a child process
// that holds a lease; TestMain hands such a child to helperMain.
const (
	helperEnv     = "FILELOCK_TEST_HELPER" // set to 1 in the child
	helperDirEnv  = "FILELOCK_TEST_DIR"
	helperNameEnv = "FILELOCK_TEST_NAME"
	helperIDEnv   = "FILELOCK_TEST_ID"
	helperTTLEnv  = "FILELOCK_TEST_TTL"
	helperModeEnv = "FILELOCK_TEST_MODE" // "elector" for electorMain
)

// helperMain is the child: it acquires the name, prints "granted <term>",
// and then holds the lease without ever renewing it until its standard input
// closes or it is killed; a line "release" on its standard input makes it
// release the lease and print "released". It returns the exit code.
func helperMain() int {
	ttl, err := time.ParseDuration(os.Getenv(helperTTLEnv))
	if err != nil {
		fmt.Fprintln(os.Stderr, "helper:", err)
		return 2
	}
	s, err := filelock.Open(os.Getenv(helperDirEnv))
	if err != nil {
		fmt.Fprintln(os.Stderr, "helper:", err)
		return 2
	}
	defer s.Close()
	if os.Getenv(helperModeEnv) == "elector" {
		return electorMain(s, os.Getenv(helperNameEnv), os.Getenv(helperIDEnv), ttl)
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	name, c := os.Getenv(helperNameEnv), newCandidate(os.Getenv(helperIDEnv))
	l, granted, err := s.Acquire(ctx, name, c, ttl)
	if err != nil || !granted {
		fmt.Fprintf(os.Stderr, "helper: acquire: granted %v, err %v, holder %q\n", granted, err, l.HolderID)
		return 2
	}
	fmt.Printf("granted %d\n", l.Term)
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		if in.Text() != "release" {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
		err := s.Release(ctx, name, c.Token, l.Term)
		cancel()
		if err != nil {
			fmt.Fprintln(os.Stderr, "helper: release:", err)
			return 2
		}
		fmt.Println("released")
	}
	return 0
}

// electorMain is the child in elector mode: it runs an Elector for name on
// s, printing "elected <term>" at each grant, until its standard input
// closes, and returns the exit code.
func electorMain(s *filelock.Store, name, id string, ttl time.Duration) int {
	e, err := leader.New(s, leader.Config{
		Name:   name,
		ID:     id,
		TTL:    ttl,
		Logger: discardLogger(),
		OnElected: func(ctx context.Context) {
			term, _ := leader.TermFrom(ctx)
			fmt.Printf("elected %d\n", term)
		},
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "helper:", err)
		return 2
	}
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		cancel()
	}()
	if err := e.Run(ctx); err != nil && ctx.Err() == nil {
		fmt.Fprintln(os.Stderr, "helper: run:", err)
		return 2
	}
	return 0
}

func discardLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }

// runElector runs an Elector with ID id for "job" on s until the test
// ends. elected receives the term of each grant to it.
func runElector(t *testing.T, s leader.Store, id string, ttl time.Duration) (e *leader.Elector, elected chan uint64) {
	t.Helper()
	elected = make(chan uint64, 8)
	e, err := leader.New(s, leader.Config{
		Name:   "job",
		ID:     id,
		TTL:    ttl,
		Logger: discardLogger(),
		OnElected: func(ctx context.Context) {
			term, _ := leader.TermFrom(ctx)
			elected <- term
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return e, elected
}

// followChild runs an Elector with ID "parent" for "job" on s until the test
// ends, and returns once it has seen the child holder lead. elected receives
// the term of each grant to the parent.
func followChild(t *testing.T, s leader.Store, ttl time.Duration) (e *leader.Elector, elected chan uint64) {
	t.Helper()
	e, elected = runElector(t, s, "parent", ttl)
	deadline := time.Now().Add(waitTimeout)
	for e.Status().Leader != "child" {
		if time.Now().After(deadline) {
			t.Fatalf("elector did not observe the child leading within %v; status %+v", waitTimeout, e.Status())
		}
		time.Sleep(5 * time.Millisecond) // poll interval
	}
	return e, elected
}
