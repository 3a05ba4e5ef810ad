//! `scripts/pg.sh`'s throwaway servers (the replica pair and the second
//! replica every `scripts/test.sh` run starts) come back whatever the last
//! run left behind. A run may end without stopping them: a CI job
//! cancelled, a machine stopped under a session. The next run on the
//! machine starts them again, and a start that fails fails every test for a
//! server's sake (seen: a replica killed with its session spent its whole
//! start-up wait on fsyncing its data directory before the crash replay,
//! and CI failed before running a test).
//!
//! Guarantees tested here, each on servers of its own (own directories,
//! free ports; `scripts/pg.sh` takes both from the environment):
//! - every throwaway server runs with `fsync = off`, which is what lets
//!   PostgreSQL skip that fsync before a crash replay;
//! - servers killed with their run (the postmaster and every child, as a
//!   stopped machine leaves them) start again with their data;
//! - a server whose data directory will not start is made anew, and a
//!   primary made anew takes its replicas with it (they could never stream
//!   from a new system identifier): every server answers and both
//!   replicas stream from the primary;
//! - but a server that does not start for a cause outside its data is
//!   kept: a port another process holds fails the run, and a pid file
//!   naming a process that is not its postmaster (pids are reused after a
//!   machine's restart) is neither signalled nor a reason to discard.
//!
//! Real servers, no timing: each assertion waits for the state it checks.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// A free port on 127.0.0.1 no other site of this process was given, and
/// none of the fixed ports `scripts/test.sh`'s own servers listen on.
fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap();
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if port != 5432 && !(54329..=54336).contains(&port) && !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// Whether the tests run as root (the servers then run as `postgres`).
fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.trim_ascii() == b"0")
}

/// Three servers `scripts/pg.sh replica2` keeps, in a directory of this
/// test's own: a primary, its replica and its second replica.
struct Site {
    root: PathBuf,
    ports: [u16; 3],
}

const NAMES: [&str; 3] = ["primary", "replica", "replica2"];

impl Site {
    fn new(name: &str) -> Site {
        let root =
            std::env::temp_dir().join(format!("bloomgate-throwaway-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        // The servers' owner (`postgres`, when the tests run as root) must
        // reach the data directories under it: the default mode (0755).
        std::fs::create_dir_all(&root).unwrap();
        Site {
            root,
            ports: [free_port(), free_port(), free_port()],
        }
    }

    fn dir(&self, i: usize) -> PathBuf {
        self.root.join(NAMES[i])
    }

    /// `bash scripts/pg.sh CMD` with every server of the script pointed at
    /// this site (those it would not start here: at a directory that does
    /// not exist, so `stop` touches nothing else).
    fn pg_sh(&self, cmd: &str) -> Output {
        Command::new("bash")
            .arg("scripts/pg.sh")
            .arg(cmd)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env("BLOOMGATE_PRIMARY_DIR", self.dir(0))
            .env("BLOOMGATE_PRIMARY_PORT", self.ports[0].to_string())
            .env("BLOOMGATE_REPLICA_DIR", self.dir(1))
            .env("BLOOMGATE_REPLICA_PORT", self.ports[1].to_string())
            .env("BLOOMGATE_REPLICA2_DIR", self.dir(2))
            .env("BLOOMGATE_REPLICA2_PORT", self.ports[2].to_string())
            .env("BLOOMGATE_PG_DIR", self.root.join("none"))
            .env("BLOOMGATE_TLS_DIR", self.root.join("none-tls"))
            .output()
            .expect("bash scripts/pg.sh")
    }

    /// Starts (or restarts) the three; returns what the script said.
    fn ensure(&self) -> String {
        let out = self.pg_sh("replica2");
        let said = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(
            out.status.success(),
            "scripts/pg.sh replica2 failed:\n{said}"
        );
        // Each port is this site's server (not one another test or run
        // left there, which pg_isready would have taken for it).
        for (i, name) in NAMES.iter().enumerate() {
            let dir = std::fs::canonicalize(self.dir(i)).unwrap();
            assert_eq!(
                self.psql(i, "SHOW data_directory").map(PathBuf::from),
                Some(dir),
                "{name}'s port is served from its own directory"
            );
        }
        said
    }

    fn psql(&self, i: usize, sql: &str) -> Option<String> {
        let out = Command::new("psql")
            .args([
                "-h",
                "127.0.0.1",
                "-U",
                "postgres",
                "-d",
                "postgres",
                "-qAtc",
            ])
            .arg(sql)
            .arg("-p")
            .arg(self.ports[i].to_string())
            .output()
            .expect("psql");
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// Waits (up to a minute) until `sql` on server `i` answers `want`.
    fn wait_for(&self, i: usize, sql: &str, want: &str) {
        let began = Instant::now();
        loop {
            let got = self.psql(i, sql);
            if got.as_deref() == Some(want) {
                return;
            }
            assert!(
                began.elapsed() < Duration::from_secs(60),
                "{} never answered {want:?} to {sql:?} (last: {got:?})",
                NAMES[i]
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Both replicas stream from this primary (the same system identifier,
    /// a WAL receiver streaming) and have replayed what it committed.
    fn replicas_follow(&self) {
        let id = "SELECT system_identifier FROM pg_control_system()";
        let primary = self.psql(0, id).expect("the primary answers");
        let mark = format!("mark_{}", self.ports[0]);
        self.psql(0, &format!("CREATE TABLE IF NOT EXISTS {mark} ()"))
            .expect("the primary takes a write");
        for i in [1, 2] {
            assert_eq!(
                self.psql(i, id).as_deref(),
                Some(primary.as_str()),
                "{} is a replica of this primary",
                NAMES[i]
            );
            self.wait_for(i, "SELECT status FROM pg_stat_wal_receiver", "streaming");
            self.wait_for(
                i,
                &format!("SELECT count(*) FROM pg_class WHERE relname = '{mark}'"),
                "1",
            );
        }
    }

    /// Kills server `i` as a stopped machine does: the postmaster frozen,
    /// every child killed (so none is restarted), then the postmaster; its
    /// pid file stays. Waits until the pid is gone.
    fn crash(&self, i: usize) {
        let pid = std::fs::read_to_string(self.dir(i).join("postmaster.pid"))
            .expect("a running server's pid file");
        let pid = pid.lines().next().unwrap().trim().to_owned();
        let kill = |args: &[&str]| {
            let _ = Command::new(args[0]).args(&args[1..]).status();
        };
        kill(&["kill", "-STOP", &pid]);
        kill(&["pkill", "-KILL", "-P", &pid]);
        kill(&["kill", "-KILL", &pid]);
        let began = Instant::now();
        while Path::new(&format!("/proc/{pid}")).exists() {
            assert!(
                began.elapsed() < Duration::from_secs(60),
                "{} (pid {pid}) outlived SIGKILL",
                NAMES[i]
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Server `i` kept on disk but unable to start: its control file
    /// emptied (the one file no start-up can do without).
    fn break_data(&self, i: usize) {
        std::fs::write(self.dir(i).join("global/pg_control"), b"").unwrap();
    }
}

impl Site {
    /// A started site whose replica replayed a table `kept`, then crashed.
    fn with_a_crashed_replica(name: &str) -> Site {
        let site = Site::new(name);
        site.ensure();
        site.psql(0, "CREATE TABLE kept ()").unwrap();
        site.wait_for(
            1,
            "SELECT count(*) FROM pg_class WHERE relname = 'kept'",
            "1",
        );
        site.crash(1);
        site
    }
}

impl Drop for Site {
    fn drop(&mut self) {
        let _ = self.pg_sh("stop");
        // The initdb logs the script writes next to each data directory
        // are inside it too.
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

#[test]
fn every_throwaway_server_runs_without_fsync() {
    let site = Site::new("fsync");
    site.ensure();
    for (i, name) in NAMES.iter().enumerate() {
        assert_eq!(
            site.psql(i, "SHOW fsync").as_deref(),
            Some("off"),
            "{name}: fsync on makes a crash replay wait for an fsync of the whole data directory"
        );
    }
}

#[test]
fn servers_killed_with_their_run_start_again_with_their_data() {
    let site = Site::new("killed");
    site.ensure();
    site.psql(0, "CREATE TABLE kept ()").unwrap();
    site.wait_for(
        1,
        "SELECT count(*) FROM pg_class WHERE relname = 'kept'",
        "1",
    );
    site.wait_for(
        2,
        "SELECT count(*) FROM pg_class WHERE relname = 'kept'",
        "1",
    );
    for i in 0..3 {
        site.crash(i);
    }
    let said = site.ensure();
    assert!(
        !said.contains("anew"),
        "a server that only crashed replays its WAL, it is not made anew:\n{said}"
    );
    for (i, name) in NAMES.iter().enumerate() {
        assert_eq!(
            site.psql(i, "SELECT count(*) FROM pg_class WHERE relname = 'kept'")
                .as_deref(),
            Some("1"),
            "{name} kept its data"
        );
    }
    site.replicas_follow();
}

#[test]
fn a_replica_that_will_not_start_is_made_anew() {
    let site = Site::new("replica");
    site.ensure();
    site.crash(1);
    site.break_data(1);
    let said = site.ensure();
    assert!(
        said.contains(&format!(
            "making the throwaway server in {} anew",
            site.dir(1).display()
        )),
        "the script says what it did:\n{said}"
    );
    site.replicas_follow();
}

#[test]
fn a_primary_made_anew_takes_its_replicas_with_it() {
    let site = Site::new("primary");
    site.ensure();
    let id = "SELECT system_identifier FROM pg_control_system()";
    let before = site.psql(0, id).unwrap();
    for i in 0..3 {
        site.crash(i);
    }
    site.break_data(0);
    site.ensure();
    assert_ne!(
        site.psql(0, id).unwrap(),
        before,
        "the primary was made anew"
    );
    site.replicas_follow();
}

#[test]
fn a_server_whose_port_another_process_holds_is_kept() {
    let site = Site::with_a_crashed_replica("port");
    let holder = std::net::TcpListener::bind(("127.0.0.1", site.ports[1]))
        .expect("the crashed replica's port");
    let out = site.pg_sh("replica2");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a server that cannot listen does not start:\n{said}"
    );
    assert!(!said.contains("anew"), "its data is kept:\n{said}");
    assert!(said.contains("held by another process"), "{said}");
    drop(holder);
    let said = site.ensure();
    assert!(!said.contains("anew"), "{said}");
    site.wait_for(
        1,
        "SELECT count(*) FROM pg_class WHERE relname = 'kept'",
        "1",
    );
    site.replicas_follow();
}

#[test]
fn a_pid_file_naming_another_process_is_neither_signalled_nor_a_reason_to_discard() {
    let site = Site::with_a_crashed_replica("pid");
    // The pid a killed replica left now names a live process of the
    // server's owner that is not a postmaster (PostgreSQL itself then
    // refuses to start: the pid may be a postmaster's it cannot tell).
    let mut sleeper = if is_root() {
        let mut c = Command::new("setpriv");
        c.args([
            "--reuid=postgres",
            "--regid=postgres",
            "--clear-groups",
            "sleep",
            "600",
        ]);
        c
    } else {
        let mut c = Command::new("sleep");
        c.arg("600");
        c
    }
    .spawn()
    .expect("a process of the server's owner");
    let other = sleeper.id();
    let pidfile = site.dir(1).join("postmaster.pid");
    let old = std::fs::read_to_string(&pidfile).unwrap();
    let rest: String = old.lines().skip(1).map(|l| format!("{l}\n")).collect();
    std::fs::write(&pidfile, format!("{other}\n{rest}")).unwrap();
    let said = site.ensure();
    let signalled = sleeper.try_wait().unwrap();
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    assert_eq!(
        signalled, None,
        "the process the pid file named was signalled"
    );
    assert!(!said.contains("anew"), "the replica kept its data:\n{said}");
    site.wait_for(
        1,
        "SELECT count(*) FROM pg_class WHERE relname = 'kept'",
        "1",
    );
    site.replicas_follow();
}
