//go:build linux || darwin || dragonfly || freebsd || illumos || netbsd || openbsd

package main

// mainUsage is "leader help".
const mainUsage = `leader runs any program as a singleton: among all the "leader run" instances
started with one election name, on one host or many, exactly one runs its
command at a time, and another takes over when it dies or steps down.

Usage:
  leader run     --name NAME [flags] -- CMD [ARGS...]   run CMD only while this instance leads
  leader once    --name NAME [flags] -- CMD [ARGS...]   run CMD on one host per cron firing
  leader status  --name NAME [--json]                   show the current leader
  leader watch   --name NAME [--json]                   print a line each time the leader changes
  leader transfer --name NAME [--to ID]                 ask the leader to hand over, to ID or the best
  leader migrate                                        create or update the PostgreSQL schema
  leader demo    [--store URL]                          watch a failover and a handover, live
  leader version                                        this binary's version and Go version (also --version)
  leader completion bash|zsh|fish                       print a shell completion script
  leader help    [COMMAND]                              this text, or a command's

Stores (--store URL, or $LEADER_STORE):
  postgres://user:password@host:5432/db   PostgreSQL (also postgresql://…), for several hosts;
                                          run "leader migrate" once first. --strategy lease
                                          (default): a dead leader is replaced when its lease
                                          runs out; --strategy advisory: as soon as PostgreSQL
                                          notices its connection closed (PostgreSQL 14+, a
                                          direct connection: no PgBouncer in transaction mode).
                                          One strategy per election: the store refuses the
                                          other; status and watch find it themselves
  etcd://user:password@host:2379,…       etcd (etcds://… over TLS, with ?cacert=, cert=,
                                          key=); keys under ?prefix= (default leader/). A
                                          dead leader is replaced when its etcd lease
                                          (whole seconds) runs out
  file:///some/dir                        the embedded store: a file lock in a local
                                          directory, for processes on this host only;
                                          the usual one: ` + defaultStoreDirHelp + `
Every command but demo needs a store: none is chosen for you, as the store
decides which instances elect one leader. Passwords in store URLs are never
printed or logged.

Logs go to stderr through slog: --log-format text (default) or json,
--log-level debug|info|warn|error.

Exit codes of run and once (as timeout(1), env(1) and "docker run"):
  N        the command's own exit code; 128+N if signal N ended it
  125      leader itself failed: a usage error (bad flag, no store, ...) or a
           runtime error (the store cannot be opened, ...)
  126, 127 the command could not be executed / was not found
Exit codes of the others:
  0        success
  1        runtime error (for example the store cannot be opened)
  2        usage error: unknown command, bad flag, a duration flag that is not
           positive, missing --name or store, or --strategy advisory on a
           server that cannot serve it

Every duration flag (--ttl, --grace, --window, --poll, --timeout) takes a positive
Go duration such as 500ms, 15s or 2m; zero or less is refused (a usage error).

Run "leader help COMMAND" or "leader COMMAND -h" for a command's flags and
their defaults.
`
