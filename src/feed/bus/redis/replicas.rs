//! A read tier (`bus.read_from = "replicas"`).
//!
//! Redis pays for every entry once per reader: each blocked `XREAD` it
//! wakes and each reply it writes (BENCHMARKS.md, "The fleet simulator").
//! A consumer's handle ([`RedisBus::reader`]) may read an online replica
//! of the primary instead, so that cost is spread over the replicas and
//! the primary carries the appends and one replication stream per replica.
//! Nothing of the consumer's reasoning changes: a replica applies the
//! primary's stream in order with the same entry IDs (the append script
//! is replicated by its effects), so what a replica holds is a prefix of
//! the primary's stream, every entry with the same `p`; a replica behind
//! only delays the entries and heartbeats a consumer reads, and a replica
//! that lost entries (a full resync from a new primary) shows as a
//! continuity break. The consumer vouches only with readings of the
//! Postgres primary's position that the stream has reached, whichever
//! node served it.
//!
//! Which replica: at each new connection, one chosen at random among those
//! the primary's `INFO replication` lists as `online` and acknowledging
//! (`lag` ≤ 2 s), at its announced address (`replica-announce-ip`
//! behind NAT; with TLS its certificate must name that address), with
//! `bus.url`'s scheme, credentials, database and files; accepted only if
//! it says it is a replica whose link is up and that follows this
//! primary's replication ID (`master_replid`: not another deployment's
//! Redis answering at a reused address). No such
//! replica (or none found within 3 s, every one tried included): the
//! primary is read. A replica that stops following its
//! primary while in use (its link broken: it keeps serving what it had,
//! without an error) leaves the consumer unproven; halfway to
//! `bus.max_lag` the consumer drops the connection ([`Bus::reconnect`]),
//! and the next one chooses again, among the replicas the primary still
//! lists online other than the one it left (that one alone: the primary);
//! the consumer reads on after its last entry there. A reader on the
//! primary for want of a replica chooses again every 10 s, so replicas
//! that come back take the reads again.
//!
//! Trust: the gateway sends `bus.url`'s credentials to the addresses the
//! primary lists, which whoever may `CONFIG SET replica-announce-ip` on a
//! replica chooses; with TLS, give `bus.ca_file` (a private CA) rather
//! than the host's store, so only your replicas' certificates pass.
//!

use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, ConnectionAddr};

use super::{BusError, RedisBus};

impl RedisBus {
    /// The replicas a reader could choose now (see the module doc): those
    /// the primary lists online and acknowledging, as `host:port`.
    pub async fn replicas_online(&mut self) -> Result<Vec<String>, BusError> {
        let mut conn = self.conn(Duration::ZERO).await?;
        let r: Result<String, _> = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut conn)
            .await;
        let info = self.forget_on_error(r)?;
        Ok(online_replicas(&info)
            .into_iter()
            .map(|(h, p)| format!("{h}:{p}"))
            .collect())
    }

    /// A connection to an online replica of the primary `primary` is
    /// connected to, chosen as the module doc says; `None`: read the
    /// primary.
    pub(super) async fn replica(
        &self,
        client: &Client,
        primary: &mut MultiplexedConnection,
        cfg: &AsyncConnectionConfig,
    ) -> Option<(MultiplexedConnection, (String, u16))> {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(primary)
            .await
            .ok()?;
        let replid = field(&info, "master_replid")?.to_string();
        let mut online = online_replicas(&info);
        // Not the one just left (it did not keep the stream current) while
        // another is online; alone, the primary is read instead.
        online.retain(|r| Some(r) != self.left.as_ref());
        while !online.is_empty() {
            let (host, port) = online.swap_remove(random_below(online.len()));
            let addr = match client.get_connection_info().addr() {
                ConnectionAddr::TcpTls { .. } => ConnectionAddr::TcpTls {
                    host: host.clone(),
                    port,
                    insecure: false,
                    tls_params: None,
                },
                _ => ConnectionAddr::Tcp(host.clone(), port),
            };
            let info = client.get_connection_info().clone().set_addr(addr);
            let replica = match &self.tls {
                Some(files) => match files.certificates() {
                    Ok(certs) => Client::build_with_tls(info, certs),
                    Err(_) => return None,
                },
                None => Client::open(info),
            };
            let Ok(replica) = replica else { continue };
            let Ok(mut c) = replica
                .get_multiplexed_async_connection_with_config(cfg)
                .await
            else {
                continue;
            };
            let said: Result<String, _> = redis::cmd("INFO")
                .arg("replication")
                .query_async(&mut c)
                .await;
            if said.is_ok_and(|i| {
                replica_link_up(&i) && field(&i, "master_replid") == Some(replid.as_str())
            }) {
                tracing::debug!(replica = %format!("{host}:{port}"), "bus: reading a replica");
                return Some((c, (host, port)));
            }
        }
        None
    }
}

/// The replicas a primary's `INFO replication` lists as `online` and
/// acknowledging (`lag` ≤ 2 s: replicas acknowledge every second), as
/// (announced host, port).
fn online_replicas(info: &str) -> Vec<(String, u16)> {
    let mut out = Vec::new();
    for line in info.lines() {
        let Some((name, fields)) = line.trim_end().split_once(':') else {
            continue;
        };
        if !name.starts_with("slave") || !name[5..].bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let field = |k: &str| {
            fields
                .split(',')
                .find_map(|kv| kv.strip_prefix(k)?.strip_prefix('='))
        };
        let (Some(ip), Some(port), Some("online"), Some(lag)) =
            (field("ip"), field("port"), field("state"), field("lag"))
        else {
            continue;
        };
        let (Ok(port), Ok(lag)) = (port.parse::<u16>(), lag.parse::<u64>()) else {
            continue;
        };
        if lag <= 2 && !ip.is_empty() {
            out.push((ip.to_string(), port));
        }
    }
    out
}

/// The value of `key` in an `INFO` reply.
fn field<'a>(info: &'a str, key: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|l| l.trim_end().strip_prefix(key)?.strip_prefix(':'))
}

/// Whether a node's `INFO replication` says it is a replica whose link to
/// its primary is up.
fn replica_link_up(info: &str) -> bool {
    let lines: Vec<&str> = info.lines().map(str::trim_end).collect();
    lines.contains(&"role:slave") && lines.contains(&"master_link_status:up")
}

/// A number below `n` (> 0), different from one connection to the next:
/// spreads a fleet's readers over the replicas.
fn random_below(n: usize) -> usize {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    (h.finish() % n as u64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Redis 7's `INFO replication` of a primary with three replicas: one
    /// online, one still loading its snapshot, one online but not
    /// acknowledging for 5 s.
    const PRIMARY: &str = "# Replication\r\nrole:master\r\nconnected_slaves:3\r\n\
        slave0:ip=10.0.0.5,port=6379,state=online,offset=8123,lag=0\r\n\
        slave1:ip=10.0.0.6,port=6380,state=wait_bgsave,offset=0,lag=0\r\n\
        slave2:ip=10.0.0.7,port=6379,state=online,offset=7000,lag=5\r\n\
        slave3:ip=redis-3.internal,port=6381,state=online,offset=8123,lag=1\r\n\
        master_failover_state:no-failover\r\nmaster_replid:abc\r\n";

    #[test]
    fn only_online_replicas_that_acknowledge_within_a_second_are_read() {
        assert_eq!(
            online_replicas(PRIMARY),
            vec![
                ("10.0.0.5".to_string(), 6379),
                ("redis-3.internal".to_string(), 6381)
            ]
        );
        assert!(
            online_replicas("# Replication\r\nrole:master\r\nconnected_slaves:0\r\n").is_empty()
        );
        // A replica's own INFO lists no replicas (and `slave_read_only` or
        // `slave_repl_offset` are not replicas).
        assert!(online_replicas(REPLICA).is_empty());
    }

    const REPLICA: &str = "# Replication\r\nrole:slave\r\nmaster_host:10.0.0.4\r\n\
        master_port:6379\r\nmaster_link_status:up\r\nslave_repl_offset:8123\r\n\
        slave_read_only:1\r\nconnected_slaves:0\r\n";

    #[test]
    fn a_replica_is_read_only_while_its_link_is_up() {
        assert!(replica_link_up(REPLICA));
        assert!(!replica_link_up(
            &REPLICA.replace("master_link_status:up", "master_link_status:down")
        ));
        // A replica promoted meanwhile is a primary: not read as a replica.
        assert!(!replica_link_up(PRIMARY));
    }

    #[test]
    fn info_fields_are_read_by_their_whole_name() {
        assert_eq!(field(PRIMARY, "master_replid"), Some("abc"));
        assert_eq!(field(PRIMARY, "master_repl"), None);
        assert_eq!(field(REPLICA, "master_port"), Some("6379"));
    }

    #[test]
    fn the_choice_stays_in_range_and_varies() {
        let picks: std::collections::HashSet<usize> = (0..200).map(|_| random_below(4)).collect();
        assert!(picks.iter().all(|&i| i < 4));
        assert!(picks.len() > 1, "{picks:?}");
    }
}
