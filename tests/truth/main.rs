//! The randomized checker: seeded histories of writes and faults against
//! real servers, every answer of the gateway judged against Postgres.
//!
//! The promise checked: **a row that exists is never answered 404, and a
//! row is never served stale after its change commits**, through every
//! feed (`wal` streamed and polled, `notify`, `queue`, and `bus`: a fleet
//! on one Redis stream) and through the faults below.
//!
//! # A history
//! A fresh database with six resources: `users` by `id` (bigint) and by
//! `email` (text: one table under two keys, `REPLICA IDENTITY FULL` so the
//! WAL carries the old email), `docs` (uuid), `tags` (text keys with
//! spaces, `%`, `/`, non-ASCII letters), `events` (bigint, a partitioned
//! table), `orders` (a composite key, `(tenant_id bigint, order_no text)`
//! its primary key, at `/tenants/{tenant_id}/orders/{order_no}`, each part
//! percent-encoded as a segment of its own), plus `marker` (see
//! Quiescence). 30 rows a table exist before
//! the first gateway starts, and a few keys of each resource are probes
//! that never exist. One writer runs transactions, one at a time: inserts,
//! updates of non-key columns, updates of the key (`users.id`,
//! `users.email`, `docs.id`, `tags.code`, `events.id`, across partitions
//! too), deletes, deleted keys inserted again, `TRUNCATE`, bulk inserts,
//! several statements in one transaction, statements rolled back to a
//! savepoint, and `PREPARE TRANSACTION` followed by `COMMIT PREPARED` (or
//! `ROLLBACK PREPARED`; not on the notify feed: Postgres refuses to
//! prepare a transaction that sent a `NOTIFY`, as its triggers do). A
//! transaction Postgres aborts (a deadlock with a gateway's DDL at
//! start-up) is retried and counted in the summary line, as an
//! application would see it. Two readers GET random present and absent
//! keys from random gateways throughout.
//!
//! `orders`' tenants are mostly a few (`1`, `12`, `123`, `0`, `-1`, ...)
//! and its order numbers as often a few short ones (`3`, `23`, `2/3`, `%`,
//! `%2F`, `a b`, `é`, ...) as new text keys, so that rows share a part and
//! keys whose parts run together alike (tenant 1 order `23`, tenant 12
//! order `3`) live side by side, and a key part comes back; its writes are
//! inserts, value updates (some setting the key's columns to themselves),
//! updates of one part of one row's key (`tenant_id` or `order_no`: the
//! old key must answer 404, the new one the row), every row of a tenant
//! moved to another, deletes (of a row, of a tenant's rows), `TRUNCATE`,
//! and deleted or moved keys inserted again. They are drawn from a stream
//! of the seed's own (`ops::Gen::orders_rng`) and join the transactions the
//! other tables' stream makes (45 % of them; in a savepoint rolled back or
//! a prepared transaction too), so that the other choices of every seed,
//! CI's among them, stay what they were before `orders` existed. A fault
//! that caches rows to update them next caches 1-3 of `orders` too, which
//! the next steps update, re-key (one part) or delete; `publication`
//! drops `orders` with its table a third of the time, `add-column` adds
//! to it too a quarter of the time, `rewrite` rewrites it too a quarter
//! of the time (its value column, or its key's columns' types).
//!
//! A history is a number of rounds (`BLOOMGATE_TRUTH_ROUNDS`, 5), each
//! 15-35 transactions with one fault injected early in it (85 % of
//! rounds), then a quiescence point.
//!
//! # The bus feed
//! A history on `bus` starts a `redis-server` of its own on a free port
//! ([`redis`]; the test fails when there is none: scripts/test.sh installs
//! it) and runs a **fleet** of two or three gateways (the seed chooses)
//! with the same `[bus]`: that server, a permanent `bus.slot`, and
//! `bus.max_lag` of 1 s (a consumer falls back to its own WAL feed before
//! a relay's failover completes) or 5 s, the default (it waits for the
//! failover), as the seed chooses; and `bus.max_direct_fallback` below
//! the fleet's size (0 to one less, from a draw of its own so that the
//! seeds' other choices are what they were before it was drawn): a bus
//! lost past `max_lag` always leaves some of the fleet without a direct
//! feed, unvouched, answering from the database or 503. The readers read
//! every gateway of the fleet, and every one that says ready is compared at quiescence, as for
//! the `second-gateway` fault (which the bus feed leaves out: it is a
//! fleet already). Each gateway of the fleet runs on a tokio runtime of
//! its own (two workers), every task of it there and every request to it
//! served there, as a process of its own: that is what lets `kill-relay`
//! end one as a crash does (below).
//!
//! A bus history with `redis-failover` among its faults may run on **Redis
//! Sentinel** instead ([`common::sentinel::Site`], shared with
//! tests/it/feed/bus/sentinel.rs: a primary, its replica and three sentinels, an
//! ACL user and a sentinel password): every gateway's `[bus]` names the
//! sentinels and the master (`bus.sentinels`, `bus.sentinel_master`, both
//! passwords), and finds the primary through them at every connection.
//! On half of those seeds (a draw of its own) the fleet reads the replica
//! (`bus.read_from = "replicas"`), so a failover's cut link strands its
//! reads before the kill.
//! Whether it does, and which of its rounds fail Redis over, come from a
//! stream of the seed's own, as the database's lifecycle does (below):
//! drawn apart, so that the other seeds, CI's among them, keep the
//! histories they had before the fault existed. It does on half the seeds,
//! always when `redis-failover` is the only bus fault selected (a replay of
//! the fault alone plays it); there each round's fault is a failover half
//! the time (every round when it is alone), and the lifecycle's faults,
//! where the history has them, come first. `restart-redis` is drawn there
//! as elsewhere but not injected (so the draws after it stay in step):
//! the primary restarted in place would race the sentinels' promotion of
//! its replica, and a lost primary is what `redis-failover` plays.
//! `redis-split-brain` also puts a history on Sentinel (always when it is
//! the only bus fault selected, with `redis-failover` as the seed draws).
//!
//! **Redis refusing the relay.** `redis-refuses` (on a Redis of the
//! history's own) and `redis-split-brain` (on Sentinel) come from a stream
//! of their own (`history::redis_draw`), on every bus history that has
//! them: each round's fault is the one that applies 30 % of the time, and
//! every round when it is the only fault selected. The others' draws stay
//! what they were.
//!
//! **Snapshots.** On half the bus seeds (a draw of its own, so that the
//! seeds' other choices stay what they were; always when
//! `damaged-snapshots` is the only fault selected) the fleet shares a
//! `bus.fleet_key_file`, with `bus.snapshot_wait` 1 s or 30 s: every
//! rebuild then loads the fleet's snapshot or makes the fleet's one scan,
//! and every gateway the faults start (`restart`, the relay's replacement)
//! joins from the snapshots and reads the stream from their place. On
//! those histories a round's fault is `damaged-snapshots` a third of the
//! time, when selected: every snapshot on the bus damaged (a byte of its
//! first chunk flipped) or deleted, half and half, then a gateway
//! restarted, which must scan what it cannot load.
//!
//! # The oracle
//! For every path the checker keeps the versions Postgres committed: the
//! body (`row_to_json` of the resource's columns, the gateway's own query)
//! or 404, each read *inside* the transaction that makes it, before its
//! COMMIT is sent. A version may be visible from the moment that COMMIT
//! is sent and stays allowed until the next version's COMMIT returned.
//! - **During the run**, an answer is a violation unless it equals a
//!   version that was committed by the time the response came back and
//!   was still current at the *cutoff*: [`model::BASE`] (2 s) before the
//!   request began, or, when the request began inside a fault's window,
//!   `BASE` before that window opened. So a 404 for a row committed more
//!   than 2 s earlier, or a body older than a commit made more than 2 s
//!   earlier, is reported. 503 and 504 are never violations.
//! - **At quiescence** (writes stopped, every gateway that should serve
//!   caught up, every fault window closed) every path ever touched is
//!   compared exactly, on every gateway that says ready on `/readyz`,
//!   with a direct `SELECT` of the same columns: same status (200 or
//!   404), same JSON value.
//!
//! # Quiescence: how "applied past the last write" is known
//! The round ends with a marker transaction: `INSERT INTO marker`, then
//! `pg_current_wal_insert_lsn()` read just before its COMMIT, whose commit
//! record therefore ends past it. On the WAL feeds the gateway publishes
//! the end LSN of each commit it applied (`Gateway::applied`); once that
//! reaches the position read, the marker and, since every feed applies in
//! commit order, every write before it have been applied. The `notify` and
//! `queue` feeds carry no LSN: there the marker row being served (`GET
//! /marker/{n}` answers 200, which needs its insert applied to the
//! filter) says the same; on the WAL feeds it is checked too. Then the
//! windows of the faults injected are let close, then 100 ms more for the
//! WAL feed's second (visible-phase) delivery, then the comparison. It is
//! reported when no gateway of the history says ready for
//! [`history::NOT_READY_LIMIT`] (20 s; a second gateway may wait for the
//! slot the first holds, and is not compared meanwhile), and when one
//! says ready but has not applied a marker within
//! [`history::CATCH_UP_LIMIT`] (10 s; a feed that resynced never delivers
//! the commits before its new slot, so a new marker is written every
//! 500 ms). A history stops at the end of the round in which its first
//! violation was found.
//!
//! # Faults and their bounds
//! Each is selected by name in `BLOOMGATE_TRUTH_FAULTS`; a fault that does
//! not apply to a feed is left out on it.
//!
//! | fault | feeds | what | window |
//! |---|---|---|---|
//! | `kill-walsender` | wal, bus (the relay's walsender and any direct feed's) | `pg_terminate_backend` of the feed's backends (`application_name = 'bloomgate-wal-feed'`), right after caching a few rows that are updated next | [`history::FEED_GAP`] (3 s) |
//! | `kill-listener` | notify, queue | the same for the `LISTEN` connection (notify) or the poller (`bloomgate-queue-feed`) | `FEED_GAP` |
//! | `drop-slot` | wal with a permanent slot, bus (`bus.slot`: the relay finds it created anew and appends a resync) | the slot's holder killed and the slot dropped from outside | `FEED_GAP` |
//! | `restart` | all | a gateway stopped (gracefully: on the bus, the relay too) and a new one started on the same config (temporary or permanent slot, as the seed chose) | none: 503 until ready |
//! | `second-gateway` | all but bus | a second gateway on the same config (on the WAL feed with a permanent slot: the same slot); both are checked while they say ready; 10-40 transactions later one of them stops | none |
//! | `publication` | wal, bus | `SET (publish = 'insert')`, a table dropped from it, or `DROP PUBLICATION`; repaired 8-30 transactions later | [`history::WATCHED`] (5 s) from the edit and from the repair |
//! | `replica-identity` | wal, bus | `users` to `REPLICA IDENTITY DEFAULT` (or `USING INDEX` on email) after caching some emails, which are updated next; back to `FULL` later; a gateway started meanwhile refuses to start (without the old key, as documented): it is replaced, not reported | `WATCHED` from each change |
//! | `partition` | all | a table with rows attached to `events`, or an attached one detached | `WATCHED` |
//! | `add-column` | all | `ALTER TABLE … ADD COLUMN` on a served table | none |
//! | `kill-relay` | bus | the gateway holding `bus.slot` (its status says it relays) killed right after caching a few rows that are updated next; a new gateway started in its place | `FEED_GAP` |
//! | `restart-redis` | bus, not on Sentinel | `SIGKILL` of the history's `redis-server` right after caching rows that are updated next; started again on the same port 1-8 transactions later and no sooner than 0, 2 or 6 s after the kill (as the seed chooses: within either `bus.max_lag`, past 1 s, past 5 s; the writer goes on meanwhile), empty, with all its data (append-only file, `fsync` at every write), or with a copy of its data taken 2-6 transactions before the kill (a stream that lost its tail, as after a failover to a lagging Redis replica), as the seed chooses | `FEED_GAP` from the kill and from the restart |
//! | `redis-failover` | bus, on Sentinel | once the replica is in sync and every sentinel sees it up (else not injected), `SIGKILL` of the primary right after caching rows that are updated next, the writer going on; half the time (as the seed chooses) the replica's link is cut 2-6 transactions before the kill (its replication user turned away), so the primary dies with entries the replica never had, asynchronous replication's loss made certain; the sentinels promote the replica (about 2 s), and the killed node is started again, empty, as the new primary's replica, so a later round fails over again (a failover the sentinels make on their own, a primary judged down on a loaded machine, is followed: the roles are swapped and the journal says so) | `FEED_GAP` from the kill and from the promotion (seen when every sentinel names the replica and it says it is a master); a quiescence waits for the promotion first |
//! | `redis-refuses` | bus, not on Sentinel | the history's `redis-server` refuses writes (reads still answer) for at least 1, 3 or 6 s and 2-8 transactions, the writer going on: `maxmemory` below its use under `noeviction` (`OOM`), or `min-replicas-to-write 1` with no replica (`NOREPLICAS`), half and half; right after caching rows that are updated next. Then it takes writes again, and no window opens: the relay held its slot across the refused appends, so the stream goes on where it stopped | `FEED_GAP` from the refusal |
//! | `redis-split-brain` | bus, on Sentinel | once the site is steady (as for `redis-failover`), the replica made a primary and every sentinel told to watch it, as a majority cut off from the primary would promote it, while the primary, which no sentinel watches now, stays a primary and takes writes on the connections open to it (the relay's among them); right after caching rows that are updated next. 2-8 transactions later, or half the time after the round's quiescence (the fleet must be current on the node the sentinels name while the other still takes writes), the isolated node is made the new primary's replica (what it took alone is lost). With snapshots, a publisher whose consumer still reads the old node stores its snapshot on the node the sentinels name: a gateway there must not take it as complete at the new relay's resync when it is labelled behind the position the resync stands for ("Lineage" in `feed::bus::redis`; `tests/it/feed/bus/sentinel.rs` `a_snapshot_of_the_old_node_never_stands_for_the_promoted_node_s_resync`) | `FEED_GAP` from the split and from the heal |
//! | `replica-pause` | all, with the replicas | `pg_wal_replay_pause()` on the second of the two read replicas in `replica_urls` (`scripts/pg.sh replica2`, the checker's own); the first stays in step, so scans need not wait for the paused one; half the time every gateway is restarted while it is behind; resumed later | none |
//!
//! | `failover` | all, on a cluster of the history's own | the standby stopped (it falls behind), 2-5 transactions later the primary's WAL segment switched (`pg_switch_wal()`, as the audit did; the read replica replays it, so once stranded it stands ahead of the new primary's positions for 16 MB of WAL) and the primary crashed (`-m immediate`), the standby promoted (a new timeline) and every gateway's connections sent to it (the proxy in front of the cluster retargeted), the writer on it; the commits the standby never had are lost, and the read replica, which had them, is stranded on the old timeline; a new standby is made of the new primary | from the crash until `FEED_GAP` after the new primary answers; the crash to the promotion is an outage |
//! | `crash` | all, on a cluster of its own | the primary stopped with `-m immediate` and started again (same timeline); with the seed's asynchronous commits (`synchronous_commit = off`, `wal_writer_delay` 300 ms) the last ones are lost | as `failover` |
//! | `sync-hold` | all, on a cluster of its own | `synchronous_standby_names = 'ghost'` for 3 s, 8 s or 62 s (past the minute a feed once gave up after): the writer's next commit waits, decoded but invisible to every other session | none: in flight, both versions are allowed; `BASE` after it returns |
//! | `outage` | all, on a cluster of its own | every connection of every gateway cut (the proxy refuses and closes them; the writer, connected directly, goes on) for at least 1, 3 or 8 s and 2-8 transactions | `FEED_GAP` from the cut; an outage |
//!
//! | `rewrite` | all | a table rewritten with no row change any feed sees: a served column's type changed with `USING` (every value changes: the new ones read in the rewriting transaction, as the writer's), a served column renamed and another added under its name, or the key's type (`docs.id … USING id`, `tags.code` between `varchar(300)` and `text`; on the WAL feeds the publication's column list taken off first); on the trigger feeds the writer's session then writes the table again only once the gateway has replaced the table's trigger function (PL/pgSQL fails its writes until then) | none |
//! | `pause` | all | a gateway's runtime held (both workers) for 3 or 4 s, as SIGSTOP holds a process, past its bound: rows it cached are updated meanwhile, and requests queued late in the pause are answered on resume and judged | none |
//! | `wal-writer` | all, on a cluster of its own | asynchronous commits while the WAL writer is at `wal_writer_delay` 10 s (set at run time) or stopped (SIGSTOP), for 3 or 8 s | none |
//! | `restore` | all, on a cluster of its own | the primary stopped (`-m immediate`), its data directory copied, started again; 3-8 steps later stopped again and the copy put back (the same system identifier and timeline, at a lower position): what was committed since is lost; a new standby is made, and the read replica, ahead of the restored primary, is left stranded | as `crash`, at each of the two restarts |
//! | `cut-over` | all, on a cluster of its own | a blue/green cut-over: the database copied with `pg_dump \| psql` to a new cluster (another system identifier) between two steps; the proxy sends new connections there and, half the time, closes the gateways' pool connections (as they age out), while the feeds', the relay's and the read replica's (and the other half the pool's) stay on the old cluster, which lives on unwritten; the writer moves (see `life`). Half the times the pool's connections close, on a direct feed, the gateway's look at where the address leads is silent too (its connections stall at the proxy) until the round's quiescence, so that only the pool's refused connections move the feed | until `db::identity::ADDRESS_EVERY` (5 s) and `FEED_GAP` after the move; with the look silent, until the quiescence lets it speak again, and `ADDRESS_EVERY` and `FEED_GAP` past that |
//! | `hang` | all, on a cluster of its own | the database hung to every gateway: the proxy passes nothing, either way, on any connection, open or new (no error, no end of stream: a primary stopped with SIGSTOP, a network that drops packets), while the writer, connected directly, goes on; for at least 3 or 8 s (past the gateways' `acquire_timeout`, 2 s) and 2-8 transactions, then everything held passes and the connections go on | `FEED_GAP` from the hang; an outage |
//! | `damaged-snapshots` | bus, with snapshots | every snapshot of the fleet's filters on the bus damaged (a byte of its first chunk flipped) or deleted, half and half; then a gateway restarted, which joins over them (see "Snapshots" above) | none |
//!
//! # What was assumed
//! `rewrite`, `pause`, `wal-writer`, `restore`, `cut-over` and `hang` are
//! what the promise once assumed instead of proving: a timing (the WAL
//! writer's delay, a timer on the request path), a position that only
//! grows (a restore), a change that is not a row change (a rewrite), a
//! connection opened after a cut-over (a gateway whose reads all hit opens
//! none), a database that refuses when it cannot be reached (one that
//! hangs answers nothing, and its connections still count as open).
//! They are drawn from a stream of the seed's own
//! (`history::assumption_draw`: half the seeds, every seed when they are
//! the only faults selected), so that every other seed, CI's among them,
//! keeps the history it had before they existed; on a history that has
//! them, each round's fault is one of them 40 % of the time. `wal-writer`,
//! `restore`, `cut-over` and `hang` need the history's own cluster (a
//! reconfigured, restored, replaced or hung primary): a history whose
//! faults are all of these runs on one. Played in turn (CI's
//! [`CI_IN_TURN_SEED`]), a history has at least one round for each, whose
//! fault is that one unless another stream's draw takes the round (on the
//! bus, snapshots' and Redis's) or the cluster is busy with another fault
//! (then none is injected).
//!
//! # The database's lifecycle
//! The last four faults run on a cluster of the history's own
//! (`common::cluster`: a primary, a standby streaming from it directly,
//! and, when the history has a replica, a read replica streaming through
//! the proxy), with every gateway connecting through a proxy
//! (`common::Proxy`); the writer connects to the primary directly. A
//! history runs there when its faults are all of these, never when none
//! is, else as a stream of the seed's own says (half the seeds; a stream
//! apart, so that the other seeds, CI's among them, draw what they drew
//! before these faults existed); there, each round's fault is one of
//! these, drawn from that stream, 60 % of the time. After a failover or a
//! crash the checker reads every path from the new primary and records it
//! as committed then (`Model::reset`): a version the failover lost stays
//! allowed within the fault's window, and is a violation after it.
//! While the database cannot be reached (an outage; a crash or a failover
//! until the new primary answers), and for [`model::STALE_AFTER`] (1 s)
//! after, an answer labelled `detail=stale` is allowed if it is a version
//! current after `BASE` before the outage began; outside one, and at
//! every quiescence, a stale label is a violation. An unlabelled answer is
//! judged as always.
//!
//! `failover-kept-slot` is a way a failover goes, drawn from a stream of
//! its own (`life::kept_slot_draw`, so that the seeds' other choices stay
//! what they were): in a history with a permanent slot (the bus's, or a
//! WAL history's when its seed chose one), half its failovers (all of
//! them when the fault is selected alone) copy the slot onto the standby
//! first, as Patroni's permanent slots keep it. On the WAL feeds the
//! gateways may then keep their filters across the promotion
//! (`feed::wal::fork`; polled, from the history file read over SQL); on
//! the bus the relay's
//! next term judges the promotion from the stream before, and the fleet
//! keeps its filters (see "A promotion the slot survived" in
//! `feed::bus`). The stream
//! draws whether the gateways end up behind the fork point (the standby
//! streams on and the old primary stops cleanly: a switchover) or ahead
//! of it (the standby stops and the old primary crashes later: a lost
//! tail), and, ahead, whether every filter is rebuilt from the old primary
//! after the standby stopped (its scan sees what the new timeline loses:
//! those filters must not be kept). Answers are judged as after any
//! failover.
//!
//! `FEED_GAP` is deliberately shorter than the WAL feed's reconnect
//! back-off cap (5 s): a gateway blind for longer than that while it says
//! ready is reported.
//!
//! On the bus, the relay killed and Redis killed are, to every consumer
//! at once, its feed's connection lost, so they get the same `FEED_GAP`;
//! the bus's documented bounds fit in it (`src/feed/bus/mod.rs`): the
//! failover takes one look of the candidates (every second) plus starting
//! a session, and the new relay starts at the stream's newest entry; a
//! consumer without proof for `bus.max_lag` (1 s in half the histories)
//! starts its own WAL feed if it wins one of the `max_direct_fallback`
//! slots, which resyncs before its first heartbeat; and meanwhile a
//! consumer that cannot prove itself current is not vouched for (the
//! gateway's `freshness_bound`, 1.5 s, is inside the oracle's 2 s), so it
//! answers 503, not stale rows, whatever `bus.max_lag` is. Redis back,
//! empty or shorter than what a consumer read, is a continuity break to
//! it (the next entry's predecessor is not the one it read last): a
//! resync, as a direct feed's after a gap, hence `FEED_GAP` again from
//! the restart. A Sentinel failover is the same two events with the
//! sentinels in between: the primary killed is Redis lost, the promotion
//! is Redis back, possibly without the entries the replica never had
//! (whatever a consumer read of them makes the next entry a break, and the
//! relay refuses to append below what it saw: `src/feed/bus/redis.rs`, "A
//! stream that went back"). So it gets the same two windows, not one from
//! the kill to past the promotion: while the sentinels decide (longer than
//! `FEED_GAP` at times), a consumer is unproven and must not be vouched
//! for, which is what the gap between them checks, as a `restart-redis`
//! down for 6 s does. Where the other windows say "the gateway", on the
//! bus it is every gateway of the fleet.
//!
//! `kill-relay` is as abrupt as the checker's in-process gateways allow:
//! the runtime the relay runs on is shut down (`shutdown_background`), so
//! every task of it, the relay's WAL feed and its appends included, is
//! dropped at the await it stands at, without the shutdown signal: none
//! of its graceful paths run (no `Interrupted` appended, no slot
//! confirmed, no goodbye), and dropping its connections closes their
//! sockets as the kernel closes a `SIGKILL`ed process's, so Postgres sees
//! its walsender's client go at once (the journal says how soon the slot
//! was free). What is not like a crash: its idle pool connections stay
//! open until the history ends (they hold nothing the bus depends on). A
//! `SIGKILL` of the real binary (tests/it/feed/bus.rs does that once) would need
//! the checker to read its gateways over HTTP and to learn their applied
//! LSN from outside; the runtime kill keeps every check the other feeds
//! have. `WATCHED` assumes the gateway checks what the feed
//! depends on at least every 2 s (issue 26 asks it to state the interval).
//! The first replica is shared with tests/it/db/replicas.rs, which pauses and
//! stops it: a history for which it is paused, or has not replayed the
//! new database within 15 s, runs without replicas (its failure message
//! says so). The checker pauses only
//! its own second replica, and always resumes it (on a panic too).
//!
//! # Running it
//! The five feed tests are `#[ignore]`d in a plain `cargo test` (about
//! six minutes together, one feed at a time, the bus's about a minute and
//! a half); `scripts/test.sh` runs them once, or:
//!
//! ```sh
//! . scripts/pg.sh && ensure_postgres && ensure_second_replica && \
//!   BLOOMGATE_TEST_DATABASE_URL=$PG_BASE_URL/postgres \
//!   cargo test --test truth -- --ignored --nocapture
//! ```
//!
//! (`scripts/test.sh --test truth -- --ignored --nocapture` does the same.)
//! Knobs, all optional:
//! - `BLOOMGATE_TRUTH_SEED`: `7`, `7,9`, `1..20` (end excluded). Default:
//!   the CI seeds, [`CI_SEEDS`] ([`BUS_CI_SEEDS`] on the bus), then
//!   [`CI_IN_TURN_SEED`] with the faults of what was assumed in turn.
//! - `BLOOMGATE_TRUTH_DURATION=10m`: a long run, histories on consecutive
//!   seeds (from the first of `BLOOMGATE_TRUTH_SEED`, else 1000) until that
//!   much time has passed, per feed.
//! - `BLOOMGATE_TRUTH_FEEDS=wal,wal-poll,notify,queue,bus` (default all).
//! - `BLOOMGATE_REDIS_SERVER`: the `redis-server` the bus feed runs
//!   (default: the one on `PATH`).
//! - `BLOOMGATE_TRUTH_FAULTS=kill-walsender,restart` or `all` (the
//!   default: every fault) or `none`; `all` in a list adds every fault.
//! - `BLOOMGATE_TRUTH_ROUNDS` (5), `BLOOMGATE_TRUTH_SLOT=temporary|permanent`
//!   (default: the seed chooses; the bus's `bus.slot` is always
//!   permanent), `BLOOMGATE_TRUTH_TRACE=1` (every step
//!   and fault as it happens), `BLOOMGATE_TRUTH_LOG=info` (the gateways'
//!   own log, a `RUST_LOG`-style filter), `BLOOMGATE_TRUTH_KEEP_GOING=1`
//!   (every round of a history even after its first violation),
//!   `BLOOMGATE_TRUTH_IN_TURN=1` (the faults of what was assumed, one per
//!   round in turn instead of drawn, on a cluster of the history's own;
//!   CI's [`CI_IN_TURN_SEED`] runs so).
//!
//! # Replay
//! Every failing history prints its violations, the end of its journal and
//! a command with its seed, feed and fault set, e.g.
//! `BLOOMGATE_TRUTH_SEED=3 BLOOMGATE_TRUTH_FAULTS=kill-walsender scripts/test.sh --test truth truth_wal_streamed -- --ignored --nocapture`.
//! The seed fixes every decision of the history (configuration, each
//! statement, which fault when, which rows are cached first); only timing
//! is not replayed (how far the gateway got when a fault lands, which
//! reads interleave), so a replay finds the same defect but not always the
//! same violation lines. At the end of each feed's run one line sums up:
//! histories, operations, faults, checks, violations.

#[path = "../common/mod.rs"]
mod common;
mod history;
mod model;
mod ops;
mod redis;
mod rng;
mod schema;

use std::time::{Duration, Instant};

use history::{Opts, Report};

/// The histories CI runs on each feed but the bus: on the WAL feeds seed 1
/// has a permanent slot, seed 3 temporary ones; seed 2 runs on a cluster
/// of its own (see "The database's lifecycle") with failovers, crashes,
/// outages and a synchronous standby's holds among its faults.
pub const CI_SEEDS: &[u64] = &[1, 2, 3];

/// The bus's (about 70 s), chosen from a long run for what they
/// inject: 1008 kills the relay of a fleet of three with `bus.max_lag` 5 s
/// (the consumers wait for the failover) and restarts Redis empty; 1011
/// kills the relay and restarts Redis with an older copy of its data (the
/// stream's tail lost) after 2 s down; 1015 restarts Redis four times
/// under a fleet of two with 1 s, down for up to 6 s (one consumer falls
/// back to a direct feed, the other waits unvouched, and both return).
/// Their `bus.max_direct_fallback` (drawn apart): 1008 two of three, 1011
/// none of three (it drops the publication too), 1015 one of two.
/// 2, as on the other feeds: the database's lifecycle under a fleet, and
/// the fleet on Redis Sentinel (its own draw: the three above keep one
/// `redis-server`), whose primary it kills twice under writes, the second
/// time after cutting the replica's link (`redis-failover`).
pub const BUS_CI_SEEDS: &[u64] = &[1008, 1011, 1015, 2];

/// After the CI seeds, on every feed: one history with only the faults of
/// what was assumed, one per round in turn (`rewrite`, `pause`,
/// `wal-writer`, `restore`, `cut-over`), on a cluster of its own, so that
/// CI plays each of them on every feed whatever the draws of the seeds
/// above.
pub const CI_IN_TURN_SEED: u64 = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Feed {
    Wal,
    WalPoll,
    Notify,
    Queue,
    /// A fleet on the bus (`[bus]`): the WAL decoded once by the relay,
    /// read from a Redis stream by every gateway.
    Bus,
}

impl Feed {
    pub const ALL: [Feed; 5] = [
        Feed::Wal,
        Feed::WalPoll,
        Feed::Notify,
        Feed::Queue,
        Feed::Bus,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Feed::Wal => "wal",
            Feed::WalPoll => "wal-poll",
            Feed::Notify => "notify",
            Feed::Queue => "queue",
            Feed::Bus => "bus",
        }
    }

    /// On the logical primary, changes decoded from its WAL (the bus's
    /// relay and its consumers' direct feeds are WAL feeds).
    pub fn is_wal(self) -> bool {
        matches!(self, Feed::Wal | Feed::WalPoll | Feed::Bus)
    }

    fn test(self) -> &'static str {
        match self {
            Feed::Wal => "truth_wal_streamed",
            Feed::WalPoll => "truth_wal_polled",
            Feed::Notify => "truth_notify",
            Feed::Queue => "truth_queue",
            Feed::Bus => "truth_bus",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    KillWalsender,
    KillListener,
    DropSlot,
    Restart,
    SecondGateway,
    Publication,
    ReplicaIdentity,
    Partition,
    AddColumn,
    ReplicaPause,
    KillRelay,
    RestartRedis,
    RedisFailover,
    Failover,
    Crash,
    SyncHold,
    Outage,
    Rewrite,
    Pause,
    WalWriter,
    Restore,
    DamagedSnapshots,
    FailoverKeptSlot,
    CutOver,
    Hang,
    RedisRefuses,
    SplitBrain,
}

impl Fault {
    pub const ALL: [Fault; 27] = [
        Fault::KillWalsender,
        Fault::KillListener,
        Fault::DropSlot,
        Fault::Restart,
        Fault::SecondGateway,
        Fault::Publication,
        Fault::ReplicaIdentity,
        Fault::Partition,
        Fault::AddColumn,
        Fault::ReplicaPause,
        Fault::KillRelay,
        Fault::RestartRedis,
        Fault::RedisFailover,
        Fault::Failover,
        Fault::Crash,
        Fault::SyncHold,
        Fault::Outage,
        Fault::Rewrite,
        Fault::Pause,
        Fault::WalWriter,
        Fault::Restore,
        Fault::DamagedSnapshots,
        Fault::FailoverKeptSlot,
        Fault::CutOver,
        Fault::Hang,
        Fault::RedisRefuses,
        Fault::SplitBrain,
    ];

    /// The database's own lifecycle: played on a cluster of the history's
    /// own (see "The database's lifecycle").
    pub fn is_lifecycle(self) -> bool {
        matches!(
            self,
            Fault::Failover | Fault::Crash | Fault::SyncHold | Fault::Outage
        )
    }

    /// What the promise once assumed (see "What was assumed"): drawn from
    /// a stream of the seed's own.
    pub fn is_assumption(self) -> bool {
        matches!(
            self,
            Fault::Rewrite
                | Fault::Pause
                | Fault::WalWriter
                | Fault::Restore
                | Fault::CutOver
                | Fault::Hang
        )
    }

    /// Played on a cluster of the history's own: the lifecycle's, and the
    /// assumptions that reconfigure, stop or restore the primary.
    pub fn needs_cluster(self) -> bool {
        self.is_lifecycle()
            || matches!(
                self,
                Fault::WalWriter
                    | Fault::Restore
                    | Fault::FailoverKeptSlot
                    | Fault::CutOver
                    | Fault::Hang
            )
    }

    pub fn name(self) -> &'static str {
        match self {
            Fault::KillWalsender => "kill-walsender",
            Fault::KillListener => "kill-listener",
            Fault::DropSlot => "drop-slot",
            Fault::Restart => "restart",
            Fault::SecondGateway => "second-gateway",
            Fault::Publication => "publication",
            Fault::ReplicaIdentity => "replica-identity",
            Fault::Partition => "partition",
            Fault::AddColumn => "add-column",
            Fault::ReplicaPause => "replica-pause",
            Fault::KillRelay => "kill-relay",
            Fault::RestartRedis => "restart-redis",
            Fault::RedisFailover => "redis-failover",
            Fault::Failover => "failover",
            Fault::Crash => "crash",
            Fault::SyncHold => "sync-hold",
            Fault::Outage => "outage",
            Fault::Rewrite => "rewrite",
            Fault::Pause => "pause",
            Fault::WalWriter => "wal-writer",
            Fault::Restore => "restore",
            Fault::DamagedSnapshots => "damaged-snapshots",
            Fault::FailoverKeptSlot => "failover-kept-slot",
            Fault::CutOver => "cut-over",
            Fault::Hang => "hang",
            Fault::RedisRefuses => "redis-refuses",
            Fault::SplitBrain => "redis-split-brain",
        }
    }

    fn applies(self, feed: Feed) -> bool {
        match self {
            Fault::KillWalsender
            | Fault::DropSlot
            | Fault::Publication
            | Fault::ReplicaIdentity
            | Fault::FailoverKeptSlot => feed.is_wal(),
            Fault::KillListener => !feed.is_wal(),
            Fault::KillRelay
            | Fault::RestartRedis
            | Fault::RedisFailover
            | Fault::DamagedSnapshots
            | Fault::RedisRefuses
            | Fault::SplitBrain => feed == Feed::Bus,
            // A bus history is a fleet already.
            Fault::SecondGateway => feed != Feed::Bus,
            _ => true,
        }
    }
}

/// The environment's knobs (see the module doc).
struct Knobs {
    seeds: Vec<u64>,
    /// Seeds were given (a replay) rather than the CI default.
    seeds_given: bool,
    duration: Option<Duration>,
    feeds: Vec<Feed>,
    faults: Vec<Fault>,
    faults_given: Option<String>,
    rounds: usize,
    permanent_slot: Option<bool>,
    trace: bool,
    keep_going: bool,
    in_turn: bool,
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

impl Knobs {
    fn from_env() -> Knobs {
        let seeds_text = env("BLOOMGATE_TRUTH_SEED");
        let seeds = match &seeds_text {
            None => CI_SEEDS.to_vec(),
            Some(text) => parse_seeds(text),
        };
        let duration = env("BLOOMGATE_TRUTH_DURATION").map(|d| {
            humantime::parse_duration(&d)
                .unwrap_or_else(|e| panic!("BLOOMGATE_TRUTH_DURATION={d:?}: {e}"))
        });
        let feeds = match env("BLOOMGATE_TRUTH_FEEDS") {
            None => Feed::ALL.to_vec(),
            Some(text) => text
                .split(',')
                .map(|f| {
                    Feed::ALL
                        .into_iter()
                        .find(|x| x.name() == f.trim())
                        .unwrap_or_else(|| {
                            panic!("BLOOMGATE_TRUTH_FEEDS: no feed {f:?} (wal, wal-poll, notify, queue, bus)")
                        })
                })
                .collect(),
        };
        let faults_given = env("BLOOMGATE_TRUTH_FAULTS");
        let default: Vec<Fault> = Fault::ALL.to_vec();
        let faults = match faults_given.as_deref() {
            None => default,
            Some("none") => Vec::new(),
            Some(text) => {
                let mut faults: Vec<Fault> = Vec::new();
                for f in text.split(',').map(str::trim) {
                    let named: Vec<Fault> = match f {
                        "all" => default.clone(),
                        _ => vec![
                            Fault::ALL
                                .into_iter()
                                .find(|x| x.name() == f)
                                .unwrap_or_else(|| {
                                    let all: Vec<_> = Fault::ALL.iter().map(|f| f.name()).collect();
                                    panic!(
                                        "BLOOMGATE_TRUTH_FAULTS: no fault {f:?} (all, {})",
                                        all.join(", ")
                                    )
                                }),
                        ],
                    };
                    for f in named {
                        if !faults.contains(&f) {
                            faults.push(f);
                        }
                    }
                }
                // In the order of `Fault::ALL`, as the default set is: the
                // draws go by position.
                faults.sort_by_key(|f| Fault::ALL.iter().position(|x| x == f));
                faults
            }
        };
        let rounds = env("BLOOMGATE_TRUTH_ROUNDS")
            .map(|r| r.parse().expect("BLOOMGATE_TRUTH_ROUNDS: a number"))
            .unwrap_or(5);
        let permanent_slot = env("BLOOMGATE_TRUTH_SLOT").map(|s| match s.as_str() {
            "permanent" => true,
            "temporary" => false,
            _ => panic!("BLOOMGATE_TRUTH_SLOT: temporary or permanent"),
        });
        Knobs {
            seeds,
            seeds_given: seeds_text.is_some(),
            duration,
            feeds,
            faults,
            faults_given,
            rounds,
            permanent_slot,
            trace: env("BLOOMGATE_TRUTH_TRACE").is_some_and(|v| v != "0"),
            keep_going: env("BLOOMGATE_TRUTH_KEEP_GOING").is_some_and(|v| v != "0"),
            in_turn: env("BLOOMGATE_TRUTH_IN_TURN").is_some_and(|v| v != "0"),
        }
    }

    /// The command that replays `seed` on `feed` with these knobs
    /// (`in_turn`: CI's history of the assumed faults in turn).
    fn replay(&self, feed: Feed, seed: u64, in_turn: bool) -> String {
        let mut vars = format!("BLOOMGATE_TRUTH_SEED={seed}");
        if in_turn && !self.in_turn {
            let all: Vec<_> = Fault::ALL
                .iter()
                .filter(|f| f.is_assumption())
                .map(|f| f.name())
                .collect();
            vars.push_str(&format!(
                " BLOOMGATE_TRUTH_FAULTS={} BLOOMGATE_TRUTH_IN_TURN=1",
                all.join(",")
            ));
        } else if let Some(f) = &self.faults_given {
            vars.push_str(&format!(" BLOOMGATE_TRUTH_FAULTS={f}"));
        }
        if self.in_turn {
            vars.push_str(" BLOOMGATE_TRUTH_IN_TURN=1");
        }
        if self.rounds != 5 {
            vars.push_str(&format!(" BLOOMGATE_TRUTH_ROUNDS={}", self.rounds));
        }
        if self.keep_going {
            vars.push_str(" BLOOMGATE_TRUTH_KEEP_GOING=1");
        }
        if let Some(p) = self.permanent_slot {
            let kind = if p { "permanent" } else { "temporary" };
            vars.push_str(&format!(" BLOOMGATE_TRUTH_SLOT={kind}"));
        }
        format!(
            "{vars} scripts/test.sh --test truth {} -- --ignored --nocapture",
            feed.test()
        )
    }
}

fn parse_seeds(text: &str) -> Vec<u64> {
    let bad = || {
        panic!("BLOOMGATE_TRUTH_SEED={text:?}: a seed, seeds separated by commas, or a range a..b")
    };
    let mut out = Vec::new();
    for part in text.split(',') {
        let part = part.trim();
        if let Some((a, b)) = part.split_once("..") {
            let (Ok(a), Ok(b)) = (a.parse::<u64>(), b.parse::<u64>()) else {
                bad()
            };
            out.extend(a..b);
        } else {
            out.push(part.parse().unwrap_or_else(|_| bad()));
        }
    }
    out
}

/// The checker's histories share the read replica and kill backends by
/// database: one at a time, whichever feed's test runs.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn check(feed: Feed) {
    let knobs = Knobs::from_env();
    if !knobs.feeds.contains(&feed) {
        eprintln!(
            "truth: feed {} not selected (BLOOMGATE_TRUTH_FEEDS)",
            feed.name()
        );
        return;
    }
    let _one = ONE_AT_A_TIME.lock().await;
    if let Some(filter) = env("BLOOMGATE_TRUTH_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .with_thread_names(true)
            .try_init();
    }
    // Every history on the logical primary, where the replica is: the WAL
    // feeds need it, and the replica fault needs its replica.
    let primary = env("BLOOMGATE_TEST_PRIMARY_URL");
    let server = match (&primary, feed.is_wal()) {
        (Some(p), _) => format!("{p}/postgres"),
        (None, true) => panic!(
            "BLOOMGATE_TEST_PRIMARY_URL unset: the WAL feed needs the logical primary; run with scripts/test.sh"
        ),
        (None, false) => env("BLOOMGATE_TEST_DATABASE_URL")
            .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/postgres".into()),
    };
    // TestDb creates (and drops) its databases there; set under the lock,
    // so no other history reads it meanwhile.
    unsafe { std::env::set_var("BLOOMGATE_TEST_DATABASE_URL", &server) };
    // The second replica (scripts/pg.sh replica2), where there is one, is
    // the one the replica fault pauses; the first stays in step, so scans
    // need not wait.
    let replicas: Vec<String> = if primary.is_some() {
        ["BLOOMGATE_TEST_REPLICA_URL", "BLOOMGATE_TEST_REPLICA2_URL"]
            .into_iter()
            .map_while(env)
            .collect()
    } else {
        Vec::new()
    };
    let faults: Vec<Fault> = knobs
        .faults
        .iter()
        .copied()
        .filter(|f| f.applies(feed))
        .filter(|f| *f != Fault::ReplicaPause || !replicas.is_empty())
        .collect();

    let began = Instant::now();
    let mut seeds: Vec<(u64, bool)> = if feed == Feed::Bus && !knobs.seeds_given {
        BUS_CI_SEEDS.to_vec()
    } else {
        knobs.seeds.clone()
    }
    .into_iter()
    .map(|s| (s, knobs.in_turn))
    .collect();
    // CI's run (no knob given): the assumed faults in turn, too.
    if !knobs.seeds_given && knobs.faults_given.is_none() && knobs.duration.is_none() {
        seeds.push((CI_IN_TURN_SEED, true));
    }
    let mut seeds = seeds.into_iter();
    let mut next_long = if knobs.seeds_given {
        knobs.seeds[0]
    } else {
        1000
    };
    let (mut histories, mut total) = (0u64, Report::default());
    let mut failed = Vec::new();
    loop {
        let (seed, in_turn) = match knobs.duration {
            Some(d) => {
                if began.elapsed() >= d {
                    break;
                }
                next_long += 1;
                (next_long - 1, knobs.in_turn)
            }
            None => match seeds.next() {
                Some(s) => s,
                None => break,
            },
        };
        let faults: Vec<Fault> = match in_turn && !knobs.in_turn {
            true => faults
                .iter()
                .copied()
                .filter(|f| f.is_assumption())
                .collect(),
            false => faults.clone(),
        };
        let report = history::run(Opts {
            feed,
            seed,
            in_turn,
            faults: faults.clone(),
            // In turn, every assumed fault gets a round.
            rounds: match in_turn {
                true => knobs
                    .rounds
                    .max(faults.iter().filter(|f| f.is_assumption()).count()),
                false => knobs.rounds,
            },
            permanent_slot: knobs.permanent_slot,
            replicas: replicas.clone(),
            trace: knobs.trace,
            keep_going: knobs.keep_going,
        })
        .await;
        histories += 1;
        total.ops += report.ops;
        total.faults += report.faults;
        total.checks += report.checks;
        total.unavailable += report.unavailable;
        total.writer_aborts += report.writer_aborts;
        total.kept += report.kept;
        if !report.violations.is_empty() {
            let n = report.violations.len();
            eprintln!(
                "\ntruth: {n} violations, seed {seed}, feed {}, faults {:?} ({})",
                feed.name(),
                faults.iter().map(|f| f.name()).collect::<Vec<_>>(),
                report.setup
            );
            for v in report.violations.iter().take(20) {
                eprintln!("  {v}");
            }
            if n > 20 {
                eprintln!("  ... and {} more", n - 20);
            }
            eprintln!("journal (last 40 lines):");
            let from = report.journal.len().saturating_sub(40);
            for line in &report.journal[from..] {
                eprintln!("  {line}");
            }
            let replay = knobs.replay(feed, seed, in_turn);
            eprintln!("replay: {replay}\n");
            total.violations.extend(report.violations);
            failed.push(replay);
        }
    }
    eprintln!(
        "truth: feed={} histories={histories} operations={} faults={} checks={} violations={} (503s: {}, writer transactions aborted by Postgres: {}, filters kept across a promotion: {}) in {:.0?}",
        feed.name(),
        total.ops,
        total.faults,
        total.checks,
        total.violations.len(),
        total.unavailable,
        total.writer_aborts,
        total.kept,
        began.elapsed()
    );
    assert!(
        failed.is_empty(),
        "{} violations on the {} feed in {} of {histories} histories; replay:\n{}",
        total.violations.len(),
        feed.name(),
        failed.len(),
        failed.join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the randomized checker (minutes): scripts/test.sh runs it; see tests/truth/main.rs"]
async fn truth_wal_streamed() {
    check(Feed::Wal).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the randomized checker (minutes): scripts/test.sh runs it; see tests/truth/main.rs"]
async fn truth_wal_polled() {
    check(Feed::WalPoll).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the randomized checker (minutes): scripts/test.sh runs it; see tests/truth/main.rs"]
async fn truth_notify() {
    check(Feed::Notify).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the randomized checker (minutes): scripts/test.sh runs it; see tests/truth/main.rs"]
async fn truth_queue() {
    check(Feed::Queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the randomized checker (minutes): scripts/test.sh runs it; see tests/truth/main.rs"]
async fn truth_bus() {
    check(Feed::Bus).await;
}
