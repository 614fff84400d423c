package postgres

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"net"
	"reflect"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leaderelect/leader/internal/pgtest"
)

// The seed corpora of these targets are in testdata/fuzz/<target>.

// FuzzOptions checks the validation of Options by NewLeaseStore and
// NewRouter: they never panic and never touch the database; they accept
// exactly the options whose names are at most 63 bytes of valid UTF-8
// without a NUL byte, with the tables and channels told apart,
// and refuse the others with an *OptionsError naming a field and its rule.
// Accepted names reach the SQL only as quoted identifiers that read back as
// given.
func FuzzOptions(f *testing.F) {
	pool, dials := offlinePool(f)
	defaults := Options{}.withDefaults()
	defaultStmts := sqlOf(defaults)

	f.Add("", "", "", "", "", "")
	f.Add("public", "leader_leases", "leader_advisory", "leader_messages", "public.leader_leases", "public.leader_messages")
	f.Add("My Schema", `t"able`, "a.b", `m""t`, "Chan", "Msg Chan")
	f.Add(strings.Repeat("s", 63), strings.Repeat("t", 63), "", "", "", "")
	f.Add(strings.Repeat("s", 64), "", "", "", "", "")
	f.Add("", "", "", "", strings.Repeat("c", 64), "")
	f.Add("a\x00b", "", "", "", "", "")
	f.Add("", `x"; DROP TABLE x; --`, "", "", "", "")

	f.Fuzz(func(t *testing.T, schema, table, advisoryTable, messageTable, channel, messageChannel string) {
		in := Options{
			Schema: schema, Table: table, AdvisoryTable: advisoryTable,
			MessageTable: messageTable, Channel: channel, MessageChannel: messageChannel,
		}
		want := documentedOptions(in)
		broken := brokenOptions(want)
		before := dials.Load()

		store, storeErr := NewLeaseStore(pool, in)
		router, routerErr := NewRouter(pool, in)
		if store != nil {
			store.Close()
		}
		if (storeErr == nil) != (routerErr == nil) || (storeErr != nil && storeErr.Error() != routerErr.Error()) {
			t.Fatalf("NewLeaseStore and NewRouter disagree: %v; %v", storeErr, routerErr)
		}
		if storeErr != nil {
			checkOptionsError(t, "NewLeaseStore", storeErr, want, broken)
			// Migrate refuses them too, before touching the database.
			ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
			defer cancel()
			checkOptionsError(t, "Migrate", Migrate(ctx, pool, in), want, broken)
			if n := dials.Load() - before; n != 0 {
				t.Fatalf("refusing %+v dialled the database %d times", in, n)
			}
			return
		}
		if n := dials.Load() - before; n != 0 {
			t.Fatalf("NewLeaseStore and NewRouter dialled the database %d times", n)
		}
		if len(broken) > 0 {
			t.Fatalf("accepted %+v, which breaks documented rules: %v", want, broken)
		}
		got := store.Options()
		if got.Schema != want.Schema || got.Table != want.Table || got.AdvisoryTable != want.AdvisoryTable ||
			got.MessageTable != want.MessageTable || got.Channel != want.Channel || got.MessageChannel != want.MessageChannel {
			t.Errorf("Options() = %+v, want the documented defaults %+v", got, want)
		}
		if r := router.Options(); r.Schema != got.Schema || r.MessageTable != got.MessageTable || r.MessageChannel != got.MessageChannel {
			t.Errorf("Router.Options() = %+v, differs from the store's %+v", r, got)
		}

		// Every name reads back from its quoted form.
		for _, q := range []struct {
			quoted string
			want   []string
		}{
			{got.qualifiedTable(), []string{got.Schema, got.Table}},
			{got.qualifiedAdvisoryTable(), []string{got.Schema, got.AdvisoryTable}},
			{got.qualifiedMessageTable(), []string{got.Schema, got.MessageTable}},
			{got.messageIndex(), []string{shortName(got.MessageTable + "_channel_id")}},
			{got.qualifiedHeartbeatTable(), []string{got.Schema, got.HeartbeatTable}},
			{got.heartbeatIndex(), []string{shortName(got.Table + "_heartbeat")}},
			{got.qualifiedStrategyTable(), []string{got.Schema, got.StrategyTable}},
			{got.qualifiedStatusView(), []string{got.Schema, shortName(got.Table + "_status")}},
			{got.qualifiedEpochTable(), []string{got.Schema, shortName(got.Table + "_epochs")}},
			{got.qualifiedFenceFunction(), []string{got.Schema, shortName(got.Table + "_fence")}},
			{got.qualifiedCandidateTable(), []string{got.Schema, shortName(got.Table + "_candidates")}},
			{got.requestIndex(), []string{shortName(got.Table + "_requests")}},
		} {
			parts, err := unquoteIdentifier(q.quoted)
			if err != nil {
				t.Fatalf("quoted name %s: %v", q.quoted, err)
			}
			if !reflect.DeepEqual(parts, q.want) {
				t.Errorf("quoted name %s reads back as %q, want %q", q.quoted, parts, q.want)
			}
		}
		if index := shortName(got.MessageTable + "_channel_id"); len(index) > maxIdentifierLength {
			t.Errorf("message index name %q is %d bytes, longer than PostgreSQL keeps", index, len(index))
		}

		// The SQL is the defaults' SQL with only the quoted names changed.
		wantStmts := strings.NewReplacer(
			defaults.qualifiedTable(), got.qualifiedTable(),
			defaults.qualifiedAdvisoryTable(), got.qualifiedAdvisoryTable(),
			defaults.qualifiedMessageTable(), got.qualifiedMessageTable(),
			defaults.messageIndex(), got.messageIndex(),
			defaults.qualifiedHeartbeatTable(), got.qualifiedHeartbeatTable(),
			defaults.heartbeatIndex(), got.heartbeatIndex(),
			defaults.qualifiedStrategyTable(), got.qualifiedStrategyTable(),
			defaults.qualifiedStatusView(), got.qualifiedStatusView(),
			defaults.qualifiedEpochTable(), got.qualifiedEpochTable(),
			defaults.qualifiedFenceFunction(), got.qualifiedFenceFunction(),
			defaults.qualifiedCandidateTable(), got.qualifiedCandidateTable(),
			defaults.requestIndex(), got.requestIndex(),
			fenceQuote(defaults), fenceQuote(got),
			// The staged and fence keys' prefixes name the table in hex
			// (see stageKeySQL).
			hex.EncodeToString([]byte(stagedKeyPrefix+defaults.qualifiedTable()+":")), hex.EncodeToString([]byte(stagedKeyPrefix+got.qualifiedTable()+":")),
			hex.EncodeToString([]byte(fenceKeyPrefix+defaults.qualifiedTable()+":")), hex.EncodeToString([]byte(fenceKeyPrefix+got.qualifiedTable()+":")),
		)
		gotStmts := sqlOf(got)
		for i := range gotStmts {
			if w := wantStmts.Replace(defaultStmts[i]); gotStmts[i] != w {
				t.Fatalf("statement %d differs from the default's beyond the quoted names:\n%s\nwant:\n%s", i, gotStmts[i], w)
			}
		}
		if s := store.sql; s.acquire != gotStmts[0] || s.renewBatch != gotStmts[1] || s.release != gotStmts[2] || s.observe != gotStmts[3] {
			t.Errorf("NewLeaseStore's statements are not built from the quoted table")
		}
		if r := router.sql; r.notifyDurable != gotStmts[4] || r.fetch != gotStmts[5] || r.remove != gotStmts[6] || r.failed != gotStmts[7] {
			t.Errorf("NewRouter's statements are not built from the quoted message table")
		}
	})
}

// offlinePool returns a pool whose every connection attempt fails, and the
// count of those attempts: NewLeaseStore, NewRouter and a refusing Migrate
// must not make any.
func offlinePool(f *testing.F) (*pgxpool.Pool, *atomic.Int64) {
	f.Helper()
	cfg, err := pgxpool.ParseConfig("host=127.0.0.1 port=1 user=fuzz dbname=fuzz connect_timeout=1")
	if err != nil {
		f.Fatal(err)
	}
	dials := new(atomic.Int64)
	cfg.ConnConfig.DialFunc = func(context.Context, string, string) (net.Conn, error) {
		dials.Add(1)
		return nil, errors.New("the fuzz target's pool never connects")
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(pool.Close)
	return pool, dials
}

// sqlOf returns the SQL built for o: the lease store's statements, the
// Router's that name its table, the candidates' and the migration script.
func sqlOf(o Options) []string {
	s := newStatements(o)
	hb := newBeatStatements(o)
	r := newRouterStatements(o.qualifiedMessageTable())
	a := newAdvisoryStatements(o)
	c := newCandidateStatements(o)
	script, err := migrationScript(o)
	if err != nil {
		script = "error: " + err.Error()
	}
	return []string{s.acquire, s.renewBatch, s.release, s.observe, r.notifyDurable, r.fetch, r.remove, r.failed,
		a.grant, a.grantQuick, a.grantLocked, a.queue, a.regrant, a.renew, a.release, a.unlock, a.observe, a.waiter, a.heldHere,
		hb.insert, hb.renew, hb.reconcile, s.request, a.request, c.enlist, c.enlistShared, c.withdraw, c.list, script}
}

// documentedOptions returns o with the defaults documented on Options
// filled in (Logger and Key aside).
func documentedOptions(o Options) Options {
	if o.Schema == "" {
		o.Schema = "public"
	}
	if o.Table == "" {
		o.Table = "leader_leases"
	}
	if o.AdvisoryTable == "" {
		o.AdvisoryTable = "leader_advisory"
	}
	if o.MessageTable == "" {
		o.MessageTable = "leader_messages"
	}
	if o.HeartbeatTable == "" {
		o.HeartbeatTable = "leader_heartbeats"
	}
	if o.StrategyTable == "" {
		o.StrategyTable = "leader_strategies"
	}
	short := func(s string) string {
		if len(s) <= 63 {
			return s
		}
		sum := sha256.Sum256([]byte(s))
		return "leader_" + hex.EncodeToString(sum[:])[:16]
	}
	if o.Channel == "" {
		o.Channel = short(o.Schema + "." + o.Table)
	}
	if o.MessageChannel == "" {
		o.MessageChannel = short(o.Schema + "." + o.MessageTable)
	}
	return o
}

// brokenOptions returns, for each name of o (defaults filled in) that
// breaks a rule, that rule, as documented: at most 63 bytes of valid UTF-8
// without a NUL byte, and the three tables (and the two channels) told
// apart.
func brokenOptions(o Options) map[string]string {
	broken := make(map[string]string)
	for field, v := range map[string]string{
		"Schema": o.Schema, "Table": o.Table, "AdvisoryTable": o.AdvisoryTable,
		"MessageTable": o.MessageTable, "Channel": o.Channel, "MessageChannel": o.MessageChannel,
		"HeartbeatTable": o.HeartbeatTable, "StrategyTable": o.StrategyTable,
	} {
		switch {
		case len(v) > 63:
			broken[field] = "at most 63 bytes"
		case strings.IndexByte(v, 0) >= 0:
			broken[field] = "no NUL byte"
		case !utf8.ValidString(v):
			broken[field] = "valid UTF-8"
		}
	}
	if o.AdvisoryTable == o.Table {
		broken["AdvisoryTable"] = "differs from Table"
	}
	if o.MessageTable == o.Table || o.MessageTable == o.AdvisoryTable {
		broken["MessageTable"] = "differs from the other tables"
	}
	if o.MessageChannel == o.Channel {
		broken["MessageChannel"] = "differs from Channel"
	}
	if o.HeartbeatTable == o.Table || o.HeartbeatTable == o.AdvisoryTable || o.HeartbeatTable == o.MessageTable {
		broken["HeartbeatTable"] = "differs from the other tables"
	}
	if o.StrategyTable == o.Table || o.StrategyTable == o.AdvisoryTable || o.StrategyTable == o.MessageTable || o.StrategyTable == o.HeartbeatTable {
		broken["StrategyTable"] = "differs from the other tables"
	}
	return broken
}

// checkOptionsError checks that err, what's refusal of want (defaults
// filled in), is a clear *OptionsError about a field that breaks a rule.
func checkOptionsError(t *testing.T, what string, err error, want Options, broken map[string]string) {
	t.Helper()
	var oe *OptionsError
	if !errors.As(err, &oe) {
		t.Fatalf("%s refused %+v with %T %v, want an *OptionsError (broken: %v)", what, want, err, err, broken)
	}
	field, ok := reflect.TypeFor[Options]().FieldByName(oe.Field)
	if !ok {
		t.Fatalf("%s: OptionsError.Field = %q, not an Options field", what, oe.Field)
	}
	if _, ok := broken[oe.Field]; !ok {
		t.Errorf("%s refused Options.%s %q, which keeps the rules; broken: %v (error: %v)", what, oe.Field, oe.Value, broken, err)
	}
	if given := reflect.ValueOf(want).FieldByIndex(field.Index).String(); oe.Value != given {
		t.Errorf("%s: OptionsError.Value = %q, want the value given (defaults filled in) %q", what, oe.Value, given)
	}
	if strings.TrimSpace(oe.Rule) == "" {
		t.Errorf("%s: OptionsError for %s has no rule", what, oe.Field)
	}
	msg := err.Error()
	if !strings.Contains(msg, "Options."+oe.Field) || !strings.Contains(msg, oe.Rule) || !strings.Contains(msg, strconv.Quote(oe.Value)) {
		t.Errorf("%s: message %q does not name Options.%s, its quoted value and the rule %q", what, msg, oe.Field, oe.Rule)
	}
	checkPrintable(t, msg)
}

// unquoteIdentifier reads a possibly qualified name quoted as PostgreSQL
// reads it: parts in double quotes, a doubled quote standing for one,
// separated by dots.
func unquoteIdentifier(s string) ([]string, error) {
	var parts []string
	for {
		rest, ok := strings.CutPrefix(s, `"`)
		if !ok {
			return nil, fmt.Errorf("part %q does not start with a quote", s)
		}
		var part strings.Builder
		for {
			i := strings.IndexByte(rest, '"')
			if i < 0 {
				return nil, fmt.Errorf("unterminated quoted part %q", s)
			}
			part.WriteString(rest[:i])
			rest = rest[i+1:]
			if after, doubled := strings.CutPrefix(rest, `"`); doubled {
				part.WriteByte('"')
				rest = after
				continue
			}
			break
		}
		parts = append(parts, part.String())
		if rest == "" {
			return parts, nil
		}
		if s, ok = strings.CutPrefix(rest, "."); !ok {
			return nil, fmt.Errorf("%q follows a quoted part", rest)
		}
	}
}

// checkPrintable fails t if msg could not be shown safely: invalid UTF-8
// or a character that is not printable.
func checkPrintable(t *testing.T, msg string) {
	t.Helper()
	if !utf8.ValidString(msg) {
		t.Errorf("message %q is not valid UTF-8", msg)
		return
	}
	for _, r := range msg {
		if !unicode.IsPrint(r) {
			t.Errorf("message %q contains the unprintable %U", msg, r)
			return
		}
	}
}

// FuzzRouterInput sends any channel name and payload with Notify and
// NotifyDurable on a real database. Neither panics; a refusal is a
// *ChannelError or a *PayloadError whose rule the input breaks; an accepted
// payload is stored byte for byte and nothing else changes in the database,
// which shows that no SQL is built from the input.
func FuzzRouterInput(f *testing.F) {
	pool := pgtest.NewPool(f)
	setupCtx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := Migrate(setupCtx, pool, Options{}); err != nil {
		f.Fatalf("Migrate: %v", err)
	}
	router, err := NewRouter(pool, Options{})
	if err != nil {
		f.Fatal(err)
	}
	// The database's tables, to compare with after each input.
	const tablesSQL = `SELECT string_agg(c.oid::regclass::text, ',' ORDER BY c.oid)
		FROM pg_class AS c WHERE c.relnamespace = 'public'::regnamespace AND c.relkind = 'r'`
	var tables string
	if err := pool.QueryRow(setupCtx, tablesSQL).Scan(&tables); err != nil {
		f.Fatal(err)
	}

	f.Add("jobs", "hello")
	f.Add("jobs", "")
	f.Add("", "x")
	f.Add(strings.Repeat("c", 63), strings.Repeat("p", MaxNotifyPayloadLen))
	f.Add(strings.Repeat("c", 64), "x")
	f.Add("jobs", strings.Repeat("p", MaxNotifyPayloadLen+1))
	f.Add("jobs", "a\x00b")
	f.Add("jobs", "\xff")
	f.Add("a\nb", "x")
	f.Add(`'); DROP TABLE leader_leases; --`, `'); DROP TABLE leader_leases; --`)
	f.Add("public.leader_messages", "x")

	f.Fuzz(func(t *testing.T, channel, payload string) {
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		defer cancel()
		channelBroken := channelRule(channel, router.Options().MessageChannel)
		payloadBroken := payloadRule(payload)
		notifyBroken := payloadBroken
		if notifyBroken == "" && len(payload) > MaxNotifyPayloadLen {
			notifyBroken = "at most MaxNotifyPayloadLen bytes"
		}

		err := router.Notify(ctx, channel, payload)
		checkRouterError(t, "Notify", err, channel, payload, channelBroken, notifyBroken)

		err = router.NotifyDurable(ctx, channel, payload)
		checkRouterError(t, "NotifyDurable", err, channel, payload, channelBroken, payloadBroken)
		if err != nil {
			return
		}
		rows, err := pool.Query(ctx, `DELETE FROM public.leader_messages WHERE channel = $1 RETURNING payload`, channel)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		var stored []string
		for rows.Next() {
			var p string
			if err := rows.Scan(&p); err != nil {
				t.Fatal(err)
			}
			stored = append(stored, p)
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		if len(stored) != 1 || stored[0] != payload {
			t.Fatalf("NotifyDurable(%q, %q) stored %q, want exactly the payload", channel, payload, stored)
		}

		var leases, messages int
		var after string
		err = pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM public.leader_leases), (SELECT count(*) FROM public.leader_messages), (`+tablesSQL+`)`).
			Scan(&leases, &messages, &after)
		if err != nil {
			t.Fatalf("after NotifyDurable(%q, %q): %v", channel, payload, err)
		}
		if leases != 0 || messages != 0 || after != tables {
			t.Fatalf("after NotifyDurable(%q, %q): %d leases, %d messages, tables %s; want 0, 0, %s",
				channel, payload, leases, messages, after, tables)
		}
	})
}

// channelRule returns the rule, documented on Router, that a channel name
// breaks: 1 to 63 bytes of valid UTF-8 without control characters (NUL
// among them), other than the message channel. "" if it keeps them.
func channelRule(channel, messageChannel string) string {
	switch {
	case channel == "" || len(channel) > 63:
		return "1 to 63 bytes"
	case !utf8.ValidString(channel):
		return "valid UTF-8"
	case channel == messageChannel:
		return "not Options.MessageChannel"
	}
	for _, r := range channel {
		if unicode.IsControl(r) {
			return "no control characters"
		}
	}
	return ""
}

// payloadRule returns the rule, documented on Router, that a payload
// breaks: valid UTF-8 without NUL bytes. "" if it keeps it.
func payloadRule(payload string) string {
	switch {
	case !utf8.ValidString(payload):
		return "valid UTF-8"
	case strings.IndexByte(payload, 0) >= 0:
		return "no NUL byte"
	}
	return ""
}

// checkRouterError checks what err, what's answer to channel and payload,
// says given the rules they break.
func checkRouterError(t *testing.T, what string, err error, channel, payload, channelBroken, payloadBroken string) {
	t.Helper()
	if err == nil {
		if channelBroken != "" || payloadBroken != "" {
			t.Fatalf("%s(%q, %q) accepted a channel or payload that breaks a rule: %q, %q", what, channel, payload, channelBroken, payloadBroken)
		}
		return
	}
	var ce *ChannelError
	var pe *PayloadError
	switch {
	case errors.As(err, &ce):
		if channelBroken == "" {
			t.Fatalf("%s refused the valid channel %q: %v", what, channel, err)
		}
		if ce.Channel != channel || strings.TrimSpace(ce.Rule) == "" {
			t.Errorf("%s: ChannelError{Channel: %q, Rule: %q}, want channel %q and a rule", what, ce.Channel, ce.Rule, channel)
		}
	case errors.As(err, &pe):
		if payloadBroken == "" {
			t.Fatalf("%s refused the valid payload %q on %q: %v", what, payload, channel, err)
		}
		if pe.Channel != channel || pe.Size != len(payload) || strings.TrimSpace(pe.Rule) == "" {
			t.Errorf("%s: PayloadError{Channel: %q, Size: %d, Rule: %q}, want channel %q, size %d and a rule",
				what, pe.Channel, pe.Size, pe.Rule, channel, len(payload))
		}
		// The payload is not repeated: the message without the quoted
		// channel name is ASCII, and an invalid payload cannot be in it.
		if rest := strings.Replace(err.Error(), strconv.Quote(channel), "", 1); strings.Contains(rest, payload) {
			t.Errorf("%s: message %q repeats the payload", what, err)
		}
	default:
		t.Fatalf("%s(%q, %q) = %v, want a *ChannelError or a *PayloadError (rules broken: %q, %q)",
			what, channel, payload, err, channelBroken, payloadBroken)
	}
	checkPrintable(t, err.Error())
}

// FuzzAdvisoryKeyHalves checks that keyHalves splits any key into the two
// unsigned 32-bit halves that pg_locks shows, and that AdvisoryKey takes
// any name.
func FuzzAdvisoryKeyHalves(f *testing.F) {
	f.Add(int64(0), "")
	f.Add(int64(-1), "jobs")
	f.Add(int64(math.MinInt64), "\x00")
	f.Add(int64(math.MaxInt64), "\xff\xfe")
	f.Add(int64(1)<<32, strings.Repeat("n", 8000))
	f.Add(int64(math.MaxUint32), "élection")

	f.Fuzz(func(t *testing.T, key int64, name string) {
		checkHalves := func(key int64) {
			hi, lo := keyHalves(key)
			if hi < 0 || hi > math.MaxUint32 || lo < 0 || lo > math.MaxUint32 {
				t.Fatalf("keyHalves(%d) = %d, %d: want both in [0, 2^32)", key, hi, lo)
			}
			if joined := uint64(hi)<<32 | uint64(lo); joined != uint64(key) {
				t.Fatalf("keyHalves(%d) = %d, %d, which join to %d", key, hi, lo, int64(joined))
			}
		}
		checkHalves(key)
		k := AdvisoryKey(name)
		if again := AdvisoryKey(name); again != k {
			t.Fatalf("AdvisoryKey(%q) = %d, then %d", name, k, again)
		}
		checkHalves(k)
	})
}
