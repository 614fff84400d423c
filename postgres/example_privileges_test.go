package postgres_test

import (
	"context"
	"crypto/rand"
	"fmt"
	"log"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader"
	"github.com/leaderelect/leader/postgres"
)

// The stores and the Router need no superuser, no right to create anything
// and no statistics role. Migrate, which creates the tables, runs as their
// owner (at deploy time, say); the role the program runs as then needs
// only these grants, here for the default Options and the role leader_app
// on the database app:
//
//	CREATE ROLE leader_app LOGIN PASSWORD '...' NOSUPERUSER NOCREATEDB NOCREATEROLE;
//	GRANT CONNECT ON DATABASE app TO leader_app;
//	GRANT USAGE ON SCHEMA public TO leader_app;
//	GRANT SELECT, INSERT, UPDATE ON public.leader_leases, public.leader_advisory, public.leader_strategies TO leader_app;
//	GRANT SELECT, INSERT ON public.leader_leases_epochs TO leader_app;
//	GRANT SELECT, INSERT, UPDATE, DELETE ON public.leader_heartbeats TO leader_app;
//	GRANT SELECT, INSERT, UPDATE, DELETE ON public.leader_leases_candidates TO leader_app;
//	GRANT SELECT, INSERT, UPDATE, DELETE ON public.leader_messages TO leader_app;
//
// The message table's identity column needs no grant on its sequence, and
// LISTEN, NOTIFY, advisory locks, pg_locks and pg_stat_activity need none.
// PostgreSQL 15 and later no longer let every role create tables in schema
// public; on older servers, REVOKE CREATE ON SCHEMA public FROM PUBLIC as
// well if the role must not. Migrate run as this role does nothing on a
// schema that is up to date, but fails (permission denied for schema
// public) on one that needs a change, even with every table in place:
// PostgreSQL checks the right to create before it looks for the table.
//
// pg_stat_activity shows how long a session has been idle only to its own
// role, its members and pg_read_all_stats: run every candidate of an
// advisory election as one role, or followers are told the holder's whole
// TTL as Lease.Remaining.
func Example_privileges() {
	ctx := context.Background()
	ownerURL := databaseURL() // here the test server's superuser
	owner, err := pgxpool.New(ctx, ownerURL)
	if err != nil {
		log.Fatal(err)
	}
	defer owner.Close()
	if err := postgres.Migrate(ctx, owner, postgres.Options{}); err != nil {
		log.Fatal(err)
	}

	role, password := exampleRole()
	r := pgx.Identifier{role}.Sanitize()
	database := pgx.Identifier{owner.Config().ConnConfig.Database}.Sanitize()
	for _, sql := range []string{
		"CREATE ROLE " + r + " LOGIN PASSWORD '" + password + "' NOSUPERUSER NOCREATEDB NOCREATEROLE",
		"GRANT CONNECT ON DATABASE " + database + " TO " + r,
		"GRANT USAGE ON SCHEMA public TO " + r,
		"GRANT SELECT, INSERT, UPDATE ON public.leader_leases, public.leader_advisory, public.leader_strategies TO " + r,
		"GRANT SELECT, INSERT ON public.leader_leases_epochs TO " + r,
		"GRANT SELECT, INSERT, UPDATE, DELETE ON public.leader_heartbeats TO " + r,
		"GRANT SELECT, INSERT, UPDATE, DELETE ON public.leader_leases_candidates TO " + r,
		"GRANT SELECT, INSERT, UPDATE, DELETE ON public.leader_messages TO " + r,
	} {
		if _, err := owner.Exec(ctx, sql); err != nil {
			log.Fatal(err)
		}
	}
	defer dropRole(owner, r)

	// The program logs in as the role.
	cfg, err := pgxpool.ParseConfig(ownerURL)
	if err != nil {
		log.Fatal(err)
	}
	cfg.ConnConfig.User, cfg.ConnConfig.Password = role, password
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	leases, err := postgres.NewLeaseStore(pool, postgres.Options{})
	if err != nil {
		log.Fatal(err)
	}
	defer leases.Close()
	locks, err := postgres.NewAdvisoryStore(ctx, pool, postgres.Options{})
	if err != nil {
		log.Fatal(err)
	}
	defer locks.Close()
	router, err := postgres.NewRouter(pool, postgres.Options{})
	if err != nil {
		log.Fatal(err)
	}

	// Electors normally make these calls; here they are made by hand, on
	// a name of each strategy (a name is elected with one strategy only).
	worker := leader.Candidate{ID: "worker-1", Token: "a random per-instance token"}
	for _, s := range []struct {
		strategy string
		store    leader.Store
	}{{"lease", leases}, {"advisory", locks}} {
		lease, granted, err := s.store.Acquire(ctx, "nightly-"+s.strategy, worker, time.Minute)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("%s strategy: granted %v to %s, term %d\n", s.strategy, granted, lease.HolderID, lease.Term)
	}
	// Followers enlist as candidates to hand over to (leader.Transferer).
	follower := leader.Candidate{ID: "worker-2", Token: "another random token"}
	if err := leases.Enlist(ctx, "nightly-lease", follower, time.Minute); err != nil {
		log.Fatal(err)
	}
	candidates, err := locks.Candidates(ctx, "nightly-lease") // one table for both strategies
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("candidates: %d\n", len(candidates))
	if err := router.NotifyDurable(ctx, "jobs", "reindex"); err != nil {
		log.Fatal(err)
	}
	fmt.Println("durable message stored")

	// The schema is up to date: there is nothing to do, and no right needed.
	if err := postgres.Migrate(ctx, pool, postgres.Options{}); err != nil {
		log.Fatal(err)
	}
	fmt.Println("Migrate as the role: up to date")
	// Output:
	// lease strategy: granted true to worker-1, term 1
	// advisory strategy: granted true to worker-1, term 1
	// candidates: 1
	// durable message stored
	// Migrate as the role: up to date
}

// exampleRole returns a role name and password of its own for each run of
// the example: roles belong to the whole server, not to the database.
func exampleRole() (name, password string) {
	return "leader_app_" + strings.ToLower(rand.Text()[:8]), rand.Text()
}

// dropRole revokes what role (quoted) was granted and drops it.
func dropRole(owner *pgxpool.Pool, role string) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, sql := range []string{"DROP OWNED BY " + role, "DROP ROLE " + role} {
		if _, err := owner.Exec(ctx, sql); err != nil {
			log.Fatal(err)
		}
	}
}
