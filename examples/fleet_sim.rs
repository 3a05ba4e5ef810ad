//! The fleet simulator (`bench/fleet.sh` runs it): what a fleet of N
//! gateways on the bus costs Redis, the relay and each gateway, and how
//! late each gateway is, at a fixed write rate, on a machine that cannot
//! run N gateways.
//!
//! In one process: one relay (a real gateway holding `bus.slot`, on a
//! runtime of its own), K real consumer gateways (the whole consumer and
//! applier, small filters, no HTTP; runtime `gws`), and N *readers*: the
//! consumer's Redis access pattern (`XREAD COUNT 1024 BLOCK 50` after the
//! last entry read, again as soon as it returns) without decoding or
//! applying, on one thread. Redis' cost depends on the reads and replies,
//! not on what a gateway does with them, so the readers load Redis as N
//! gateways would (a little more: they come back sooner than a gateway
//! that applies what it read); what a gateway itself costs per commit is
//! the K real ones'. Two cores could not run 256 appliers at 5,000 commits
//! a second (1.28 million commit applications a second).
//!
//! Commit to servable: a marker row inserted every 20 ms; the time from
//! its COMMIT returning until a real consumer's applied position reaches
//! the WAL position read after it (a slight overestimate), and until a
//! reader has read an entry at or past it (delivery only).
//!
//! With a read tier (`REPLICAS`: `url|pid` of each replica of the Redis
//! primary, comma-separated, as bench/fleet.sh sets it): the readers are
//! spread over the replicas, round robin, and the real gateways read with
//! `bus.read_from = "replicas"`; each replica's CPU is counted apart from
//! the primary's.
//!
//! Arguments: `DB_URL REDIS_URL REDIS_PID READERS CONSUMERS RATE SECS`.
//! Prints one line of `key=value`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bloomgate::config::Config;
use bloomgate::gateway::Gateway;
use tokio::sync::Mutex;

const SLOT: &str = "bloomgate_fleet_sim";
const PREFIX: &str = "fleetsim";

fn config(db: &str, redis: &str) -> Config {
    // `bus.batch_window` as bench/fleet.sh's BATCH_WINDOW says.
    let window = std::env::var("BATCH_WINDOW").unwrap_or_else(|_| "2ms".into());
    let read_from = if replicas().is_empty() {
        "primary"
    } else {
        "replicas"
    };
    let text = format!(
        r#"
[database]
url = "{db}"
pool_size = 1
migrate = false
freshness = "wal"
install_feed = true
[bus]
url = "{redis}"
slot = "{SLOT}"
prefix = "{PREFIX}"
batch_window = "{window}"
read_from = "{read_from}"
[filter]
rebuild_interval = "0s"
rebuild_insert_fraction = 0
rebuild_fp_multiple = 0
[[resource]]
name = "users"
route = "/users/{{id}}"
table = "tc_users"
key_column = "id"
key_type = "bigint"
columns = ["id", "email"]
"#
    );
    Config::from_toml(&text).expect("the simulator's config")
}

/// CPU ticks (user + system) of this process's threads whose name starts
/// with `prefix`.
fn thread_ticks(prefix: &str) -> u64 {
    let mut total = 0;
    for t in std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten()
    {
        let Ok(stat) = std::fs::read_to_string(t.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        if !stat[open + 1..close].starts_with(prefix) {
            continue;
        }
        let f: Vec<&str> = stat[close + 2..].split(' ').collect();
        total += f[11].parse::<u64>().unwrap_or(0) + f[12].parse::<u64>().unwrap_or(0);
    }
    total
}

fn process_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let Some(close) = stat.rfind(')') else {
        return 0;
    };
    let f: Vec<&str> = stat[close + 2..].split(' ').collect();
    f.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
}

fn runtime(name: &'static str, workers: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .thread_name(name)
        .enable_all()
        .build()
        .unwrap()
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

/// `REPLICAS`: each replica's URL and process id.
fn replicas() -> Vec<(String, u32)> {
    std::env::var("REPLICAS")
        .unwrap_or_default()
        .split(',')
        .filter(|r| !r.is_empty())
        .map(|r| {
            let (url, pid) = r.split_once('|').expect("REPLICAS: url|pid,…");
            (url.to_string(), pid.parse().expect("REPLICAS: a pid"))
        })
        .collect()
}

/// Markers: (LSN after the commit, when the commit returned).
type Markers = Arc<Mutex<Vec<(u64, Instant)>>>;

/// A reader: the consumer's reads, nothing done with what they return;
/// records when each marker's position was first read.
async fn reader(
    redis: String,
    stream: String,
    stop: Arc<AtomicBool>,
    markers: Markers,
    seen: Arc<Mutex<Vec<f64>>>,
) {
    let client = redis::Client::open(redis).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let mut last = String::from("$");
    let mut next_marker = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let v: redis::Value = redis::cmd("XREAD")
            .arg("COUNT")
            .arg(1024)
            .arg("BLOCK")
            .arg(50)
            .arg("STREAMS")
            .arg(&stream)
            .arg(&last)
            .query_async(&mut conn)
            .await
            .unwrap_or(redis::Value::Nil);
        let Some(id) = last_id(&v) else { continue };
        last = id.clone();
        let lsn: u64 = id.split('-').next().unwrap().parse().unwrap_or(0);
        let now = Instant::now();
        let m = markers.lock().await;
        let mut got = Vec::new();
        while next_marker < m.len() && m[next_marker].0 <= lsn {
            got.push(now.duration_since(m[next_marker].1).as_secs_f64() * 1e3);
            next_marker += 1;
        }
        drop(m);
        seen.lock().await.extend(got);
    }
}

/// The ID of the last entry of an XREAD reply.
fn last_id(v: &redis::Value) -> Option<String> {
    use redis::Value as V;
    let items = |v: &V| -> Option<Vec<V>> {
        match v {
            V::Array(a) | V::Set(a) => Some(a.clone()),
            V::Map(m) => Some(m.iter().map(|(_, v)| v.clone()).collect()),
            _ => None,
        }
    };
    let streams = items(v)?;
    let s = streams.first()?;
    let entries = match s {
        V::Array(pair) if pair.len() == 2 => items(&pair[1])?,
        other => items(other)?,
    };
    let last = entries.last()?;
    let pair = items(last)?;
    match pair.first()? {
        V::BulkString(b) => String::from_utf8(b.clone()).ok(),
        V::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

/// The stream's memory (`MEMORY USAGE … SAMPLES 0`: every node counted)
/// and its length: what a second of retention costs Redis.
async fn stream_size(url: &str, stream: &str) -> (i64, i64) {
    let client = redis::Client::open(url).unwrap();
    // A Redis that 256 readers keep busy may not accept a connection
    // within redis-rs' default time-out at once.
    let mut tries = 0;
    let mut c = loop {
        match client.get_multiplexed_async_connection().await {
            Ok(c) => break c,
            Err(e) if tries >= 10 => panic!("Redis: {e}"),
            Err(_) => tries += 1,
        }
    };
    let bytes: Option<i64> = redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(stream)
        .arg("SAMPLES")
        .arg(0)
        .query_async(&mut c)
        .await
        .unwrap();
    let len: i64 = redis::cmd("XLEN")
        .arg(stream)
        .query_async(&mut c)
        .await
        .unwrap();
    (bytes.unwrap_or(0), len)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 8 {
        eprintln!("usage: fleet_sim DB_URL REDIS_URL REDIS_PID READERS CONSUMERS RATE SECS");
        std::process::exit(2);
    }
    let (db, redis_url) = (args[1].clone(), args[2].clone());
    let redis_pid: u32 = args[3].parse().unwrap();
    let readers: usize = args[4].parse().unwrap();
    let consumers: usize = args[5].parse().unwrap();
    let rate: u64 = args[6].parse().unwrap();
    let secs: u64 = args[7].parse().unwrap();

    let relay_rt = runtime("relay", 2);
    let gws_rt = runtime("gws", 2);
    let readers_rt = runtime("readers", 1);
    let main_rt = runtime("sim", 1);

    let relay = {
        let _in = relay_rt.enter();
        Gateway::new(config(&db, &redis_url), &Default::default()).unwrap()
    };
    relay_rt.block_on(async { relay.start().await.unwrap() });
    main_rt.block_on(async {
        let began = Instant::now();
        while !relay.bus_status().unwrap().get().relaying {
            assert!(began.elapsed() < Duration::from_secs(30), "no relay");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    let stream = relay.bus_status().unwrap().get().stream;
    let mut gws = Vec::new();
    for _ in 0..consumers {
        let g = {
            let _in = gws_rt.enter();
            Gateway::new(config(&db, &redis_url), &Default::default()).unwrap()
        };
        gws_rt.block_on(async { g.start().await.unwrap() });
        gws.push(g);
    }

    let stop = Arc::new(AtomicBool::new(false));
    let markers: Markers = Arc::default();
    let delivered = Arc::new(Mutex::new(Vec::new()));
    let mut reader_tasks = Vec::new();
    let replicas = replicas();
    for i in 0..readers {
        let url = match replicas.len() {
            0 => redis_url.clone(),
            k => replicas[i % k].0.clone(),
        };
        reader_tasks.push(readers_rt.spawn(reader(
            url,
            stream.clone(),
            stop.clone(),
            markers.clone(),
            delivered.clone(),
        )));
    }
    // Each real consumer: when its applied position passes each marker.
    let applied_ms = Arc::new(Mutex::new(Vec::new()));
    let mut watchers = Vec::new();
    for g in &gws {
        let (mut applied, markers, out, stop) = (
            g.applied(),
            markers.clone(),
            applied_ms.clone(),
            stop.clone(),
        );
        watchers.push(gws_rt.spawn(async move {
            let mut next = 0usize;
            while !stop.load(Ordering::Relaxed) {
                if tokio::time::timeout(Duration::from_millis(100), applied.changed())
                    .await
                    .is_ok_and(|r| r.is_err())
                {
                    return;
                }
                let lsn = applied.borrow().lsn.0;
                let now = Instant::now();
                let m = markers.lock().await;
                let mut got = Vec::new();
                while next < m.len() && m[next].0 <= lsn {
                    got.push(now.duration_since(m[next].1).as_secs_f64() * 1e3);
                    next += 1;
                }
                drop(m);
                out.lock().await.extend(got);
            }
        }));
    }
    // Settle, then measure over the load.
    std::thread::sleep(Duration::from_secs(2));
    let commits = Arc::new(AtomicU64::new(0));
    let (r0, relay0, gws0, readers0) = (
        process_ticks(redis_pid),
        thread_ticks("relay"),
        thread_ticks("gws"),
        thread_ticks("readers"),
    );
    let replica_ticks =
        || -> Vec<u64> { replicas.iter().map(|(_, p)| process_ticks(*p)).collect() };
    let replicas0 = replica_ticks();
    let (bytes0, entries0) = main_rt.block_on(stream_size(&redis_url, &stream));
    let began = Instant::now();
    let marker_task = main_rt.spawn({
        let (db, markers, stop) = (db.clone(), markers.clone(), stop.clone());
        async move {
            let mut c: sqlx::PgConnection =
                sqlx::Connection::connect(&db).await.unwrap();
            while !stop.load(Ordering::Relaxed) {
                sqlx::query(
                    "INSERT INTO tc_users (email, name) VALUES (md5(random()::text || clock_timestamp()::text), 'marker')",
                )
                .execute(&mut c)
                .await
                .unwrap();
                let at = Instant::now();
                let lsn: i64 = sqlx::query_scalar(
                    "SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::int8",
                )
                .fetch_one(&mut c)
                .await
                .unwrap();
                markers.lock().await.push((lsn as u64, at));
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    let pgbench = std::process::Command::new("pgbench")
        .args([
            "-n",
            "-f",
            "bench/pgbench/insert.sql",
            "-c",
            "4",
            "-j",
            "2",
            "-R",
            &rate.to_string(),
            "-T",
            &secs.to_string(),
            &db,
        ])
        .output()
        .expect("pgbench");
    let out = String::from_utf8_lossy(&pgbench.stdout).to_string();
    let txns: u64 = out
        .lines()
        .find(|l| l.contains("number of transactions actually processed"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|n| n.split('/').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    commits.store(txns, Ordering::Relaxed);
    // Let the fleet catch up with the last commits before the clock stops.
    std::thread::sleep(Duration::from_millis(500));
    let (r1, relay1, gws1, readers1) = (
        process_ticks(redis_pid),
        thread_ticks("relay"),
        thread_ticks("gws"),
        thread_ticks("readers"),
    );
    let replicas1 = replica_ticks();
    let elapsed = began.elapsed().as_secs_f64();
    let (bytes1, entries1) = main_rt.block_on(stream_size(&redis_url, &stream));
    stop.store(true, Ordering::Relaxed);
    main_rt.block_on(async {
        let _ = marker_task.await;
    });
    for t in reader_tasks {
        let _ = readers_rt.block_on(t);
    }
    for t in watchers {
        let _ = gws_rt.block_on(t);
    }
    let n = txns.max(1) as f64;
    // Ticks are 1/100 s: µs per commit is ticks * 10,000 / commits.
    let per = |ticks: u64| ticks as f64 * 10_000.0 / n;
    let (mut d, mut a) = main_rt.block_on(async {
        (
            delivered.lock().await.clone(),
            applied_ms.lock().await.clone(),
        )
    });
    let on_replicas: Vec<f64> = replicas0
        .iter()
        .zip(&replicas1)
        .map(|(a, b)| per(b - a))
        .collect();
    println!(
        "readers={readers} consumers={consumers} rate={rate} commits={txns} commits_per_s={:.0} \
         replicas={} replicas_us_per_commit={:.1} busiest_replica_us_per_commit={:.1} \
         redis_us_per_commit={:.1} relay_us_per_commit={:.1} consumer_us_per_commit={:.1} \
         readers_us_per_commit={:.1} delivered_ms_p50={:.1} delivered_ms_p99={:.1} \
         servable_ms_p50={:.1} servable_ms_p99={:.1} entries_per_s={:.0} \
         stream_bytes_per_entry={:.0} stream_bytes_per_s={:.0}",
        n / elapsed,
        replicas.len(),
        on_replicas.iter().sum::<f64>(),
        on_replicas.iter().copied().fold(0.0, f64::max),
        per(r1 - r0),
        per(relay1 - relay0),
        per(gws1 - gws0) / consumers.max(1) as f64,
        per(readers1 - readers0),
        percentile(&mut d, 0.5),
        percentile(&mut d, 0.99),
        percentile(&mut a, 0.5),
        percentile(&mut a, 0.99),
        (entries1 - entries0) as f64 / elapsed,
        (bytes1 - bytes0) as f64 / (entries1 - entries0).max(1) as f64,
        (bytes1 - bytes0) as f64 / elapsed,
    );
    for g in &gws {
        let _in = gws_rt.enter();
        g.stop();
    }
    {
        let _in = relay_rt.enter();
        relay.stop();
    }
    std::thread::sleep(Duration::from_secs(1));
    relay_rt.shutdown_background();
    gws_rt.shutdown_background();
    readers_rt.shutdown_background();
    main_rt.shutdown_background();
}
