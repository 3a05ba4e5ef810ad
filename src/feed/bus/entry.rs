//! One entry of the bus, and its encoding: a kind (`k`: `b` a batch of
//! commits, `c` one commit, `h` heartbeat, `r` resync, `v` coverage, `i`
//! interruption, `f` a promotion the relay's slot survived) and a JSON
//! body (`d`). A commit carries what the applier
//! reads and nothing else: its xid, LSN, commit time, and per changed row
//! the table, the operation and the watched columns of the new and old row
//! (a value is `null`, its canonical text, or `0` for "not carried",
//! [`Value::Unknown`]), and the tables it truncated. A batch is an array of
//! commits in commit order, each with its LSN (`l`); the entry is placed at
//! the last one's. Batches are what the relay appends: every consumer's
//! read, and every wake-up of a blocked read, costs Redis the same whether
//! the entry holds one commit or hundreds (see `relay`).

use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use serde_json::{Value as Json, json};

use crate::feed::{
    Columns, Commit, Coverage, Fork, Lsn, Op, Phase, Position, Resync, RowChange, Scope, Server,
    Timeline, Value,
};

/// What the relay appends.
#[derive(Debug)]
pub enum Entry {
    Commit(Commit),
    /// Commits in commit order, each with its position; never empty.
    Batch(Vec<Commit>),
    /// Every commit ending at or before this LSN is in the stream.
    Heartbeat(Lsn),
    Resync(Resync),
    Coverage(Coverage),
    /// The relay's stream stopped; why.
    Interrupted(String),
    /// The first entry of a new epoch's stream whose relay proved its slot
    /// survived the promotion (see "A promotion the slot survived" in
    /// [`super`]).
    Fork(Forked),
}

/// A promotion the relay proved: the stream it continues, the fork, and
/// where the new stream takes over from the old one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Forked {
    /// The epoch of the stream the relay continued.
    pub from: Server,
    pub fork: Fork,
    /// `min(A, F)`: `A` the old stream's newest position when the relay
    /// started, `F` the fork. Every commit of the new history up to it is
    /// in the old stream; every one after it is in the new stream. The
    /// entry is placed there. At or before the fork, it names the same
    /// point of both timelines' histories: an LSN of `from`'s stream and
    /// of the new one compare with it alike.
    pub kept: Lsn,
}

impl Entry {
    /// The kind, as the stream names it.
    pub fn kind(&self) -> &'static str {
        match self {
            Entry::Commit(_) => "c",
            Entry::Batch(_) => "b",
            Entry::Heartbeat(_) => "h",
            Entry::Resync(_) => "r",
            Entry::Coverage(_) => "v",
            Entry::Interrupted(_) => "i",
            Entry::Fork(_) => "f",
        }
    }

    /// The LSN that places it: a commit's and a heartbeat's own, the
    /// position a resync stands for ([`Resync::upto`]), 0 for the rest
    /// (placed after the newest entry: "Lineage" in `redis`).
    pub fn lsn(&self) -> u64 {
        match self {
            Entry::Commit(c) => c.position.map_or(0, |p| p.lsn.0),
            Entry::Batch(b) => b.last().and_then(|c| c.position).map_or(0, |p| p.lsn.0),
            Entry::Heartbeat(l) => l.0,
            Entry::Resync(r) => r.upto.map_or(0, |p| p.lsn.0),
            Entry::Fork(f) => f.kept.0,
            _ => 0,
        }
    }

    /// The body, `d`.
    pub fn encode(&self) -> String {
        let v = match self {
            Entry::Commit(c) => commit_body(c),
            Entry::Batch(b) => Json::Array(
                b.iter()
                    .map(|c| {
                        let mut body = commit_body(c);
                        body["l"] = json!(c.position.map_or(0, |p| p.lsn.0));
                        body
                    })
                    .collect(),
            ),
            Entry::Heartbeat(_) => Json::Null,
            Entry::Resync(r) => json!({
                "why": r.reason,
                "t": match &r.scope { Scope::All => None, Scope::Table(t) => Some(&**t) },
            }),
            Entry::Coverage(c) => json!({ "t": &*c.table, "p": c.problem }),
            Entry::Interrupted(why) => json!({ "why": why }),
            // The system identifier as text: JSON readers elsewhere (a
            // person's `XRANGE`, another language) read numbers as doubles.
            Entry::Fork(f) => json!({
                "sys": f.from.timeline.system.to_string(),
                "from": f.from.timeline.id,
                "start": f.from.started_us,
                "at": f.fork.at.0,
                "to": f.fork.to.id,
                "kept": f.kept.0,
            }),
        };
        v.to_string()
    }

    /// The entry of kind `kind` at `lsn` with body `body`, read from the
    /// stream of `timeline` (a commit's position is on it).
    pub fn decode(kind: &str, timeline: Timeline, lsn: u64, body: &str) -> Result<Entry, String> {
        let v: Json = serde_json::from_str(body).map_err(|e| format!("entry body: {e}"))?;
        let text = |v: &Json, field: &str| -> Result<String, String> {
            v.get(field)
                .and_then(Json::as_str)
                .map(str::to_string)
                .ok_or_else(|| format!("entry field {field} missing"))
        };
        Ok(match kind {
            "c" => Entry::Commit(commit(&v, Position::new(timeline, Lsn(lsn)))?),
            "b" => {
                let items = v.as_array().ok_or("batch: not an array")?;
                let mut commits = Vec::with_capacity(items.len());
                for item in items {
                    let l = item
                        .get("l")
                        .and_then(Json::as_u64)
                        .ok_or("batch: a commit without its LSN")?;
                    commits.push(commit(item, Position::new(timeline, Lsn(l)))?);
                }
                if commits.is_empty() {
                    return Err("batch: empty".into());
                }
                Entry::Batch(commits)
            }
            "h" => Entry::Heartbeat(Lsn(lsn)),
            // Where it stands is its ID's business; a consumer reads on
            // after the ID, whatever placed it.
            "r" => Entry::Resync(Resync {
                reason: text(&v, "why")?,
                scope: match v.get("t").and_then(Json::as_str) {
                    None => Scope::All,
                    Some(t) => Scope::Table(Arc::from(t)),
                },
                upto: None,
            }),
            "v" => Entry::Coverage(Coverage {
                table: Arc::from(text(&v, "t")?),
                problem: v.get("p").and_then(Json::as_str).map(str::to_string),
            }),
            "i" => Entry::Interrupted(text(&v, "why")?),
            "f" => {
                let num = |field: &str| {
                    v.get(field)
                        .and_then(Json::as_u64)
                        .ok_or_else(|| format!("entry field {field} missing"))
                };
                let system: u64 = text(&v, "sys")?
                    .parse()
                    .map_err(|_| "entry field sys: not a number".to_string())?;
                let id = |field: &str| {
                    num(field).and_then(|n| {
                        u32::try_from(n).map_err(|_| format!("entry field {field}: out of range"))
                    })
                };
                let started_us = v
                    .get("start")
                    .and_then(Json::as_i64)
                    .ok_or("entry field start missing")?;
                let from = Timeline {
                    system,
                    id: id("from")?,
                };
                Entry::Fork(Forked {
                    from: Server {
                        timeline: from,
                        started_us,
                    },
                    fork: Fork {
                        from,
                        at: Lsn(num("at")?),
                        to: Timeline {
                            system,
                            id: id("to")?,
                        },
                    },
                    kept: Lsn(num("kept")?),
                })
            }
            other => return Err(format!("unknown entry kind {other:?}")),
        })
    }
}

fn commit_body(c: &Commit) -> Json {
    json!({
        "x": c.xid,
        "t": c.committed_at.and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map(|d| d.as_micros() as u64),
        "ch": c.changes.iter().map(|r| json!([
            &*r.table,
            match r.op { Op::Insert => "i", Op::Update => "u", Op::Delete => "d" },
            r.new.as_ref().map(columns),
            r.old.as_ref().map(columns),
        ])).collect::<Vec<_>>(),
        "tr": c.truncated.iter().map(|t| &**t).collect::<Vec<_>>(),
    })
}

/// A commit's body at `position`.
fn commit(v: &Json, position: Position) -> Result<Commit, String> {
    let changes = v
        .get("ch")
        .and_then(Json::as_array)
        .ok_or("entry field ch missing")?
        .iter()
        .map(row)
        .collect::<Result<Vec<_>, String>>()?;
    let truncated = v
        .get("tr")
        .and_then(Json::as_array)
        .map(|a| a.iter().filter_map(Json::as_str).map(Arc::from).collect())
        .unwrap_or_default();
    Ok(Commit {
        xid: v.get("x").and_then(Json::as_u64).map(|x| x as u32),
        position: Some(position),
        committed_at: v
            .get("t")
            .and_then(Json::as_u64)
            .map(|us| UNIX_EPOCH + Duration::from_micros(us)),
        phase: Phase::Received,
        changes,
        truncated,
    })
}

fn columns(c: &Columns) -> Json {
    Json::Array(
        c.0.iter()
            .map(|(name, v)| {
                json!([
                    &**name,
                    match v {
                        Value::Null => Json::Null,
                        Value::Text(t) => Json::String(t.clone()),
                        Value::Unknown => json!(0),
                    }
                ])
            })
            .collect(),
    )
}

fn parse_columns(v: &Json) -> Result<Option<Columns>, String> {
    if v.is_null() {
        return Ok(None);
    }
    let a = v.as_array().ok_or("columns: not an array")?;
    let mut out = Vec::with_capacity(a.len());
    for pair in a {
        let (Some(name), Some(value)) = (pair.get(0).and_then(Json::as_str), pair.get(1)) else {
            return Err("columns: not [name, value]".into());
        };
        let value = match value {
            Json::Null => Value::Null,
            Json::String(s) => Value::Text(s.clone()),
            _ => Value::Unknown,
        };
        out.push((Arc::from(name), value));
    }
    Ok(Some(Columns(out)))
}

fn row(v: &Json) -> Result<RowChange, String> {
    let a = v.as_array().ok_or("change: not an array")?;
    let table = a.first().and_then(Json::as_str).ok_or("change: no table")?;
    let op = match a.get(1).and_then(Json::as_str) {
        Some("i") => Op::Insert,
        Some("u") => Op::Update,
        Some("d") => Op::Delete,
        _ => return Err("change: unknown operation".into()),
    };
    Ok(RowChange {
        table: Arc::from(table),
        op,
        new: parse_columns(a.get(2).unwrap_or(&Json::Null))?,
        old: parse_columns(a.get(3).unwrap_or(&Json::Null))?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TL: Timeline = Timeline { system: 7, id: 2 };

    #[test]
    fn a_commit_round_trips_with_null_unknown_and_text_values() {
        let cols = |v: Vec<(&str, Value)>| {
            Columns(v.into_iter().map(|(n, v)| (Arc::from(n), v)).collect())
        };
        let c = Commit {
            xid: Some(7),
            position: Some(Position::new(TL, Lsn(0x1_0000_0042))),
            committed_at: Some(UNIX_EPOCH + Duration::from_micros(1_700_000_000_123_456)),
            phase: Phase::Visible,
            changes: vec![
                RowChange {
                    table: Arc::from("public.users"),
                    op: Op::Update,
                    new: Some(cols(vec![
                        ("id", Value::Text("1".into())),
                        ("email", Value::Text("a\"b@x".into())),
                    ])),
                    old: Some(cols(vec![("id", Value::Null), ("email", Value::Unknown)])),
                },
                RowChange {
                    table: Arc::from("public.users"),
                    op: Op::Delete,
                    new: None,
                    old: Some(cols(vec![("id", Value::Text("2".into()))])),
                },
            ],
            truncated: vec![Arc::from("public.things")],
        };
        let e = Entry::Commit(c.clone());
        let Entry::Commit(back) = Entry::decode("c", TL, e.lsn(), &e.encode()).unwrap() else {
            panic!("not a commit")
        };
        assert_eq!(back.xid, c.xid);
        assert_eq!(back.position, c.position);
        assert_eq!(back.committed_at, c.committed_at);
        assert_eq!(back.changes, c.changes);
        assert_eq!(back.truncated, c.truncated);
        // Applied once, at receipt: the relay appends visible commits only.
        assert_eq!(back.phase, Phase::Received);
    }

    #[test]
    fn a_batch_round_trips_each_commit_at_its_own_position() {
        let c = |lsn: u64, id: &str| Commit {
            xid: Some(lsn as u32),
            position: Some(Position::new(TL, Lsn(lsn))),
            committed_at: None,
            phase: Phase::Visible,
            changes: vec![RowChange {
                table: Arc::from("public.users"),
                op: Op::Insert,
                new: Some(Columns(vec![(Arc::from("id"), Value::Text(id.into()))])),
                old: None,
            }],
            truncated: vec![],
        };
        let e = Entry::Batch(vec![c(10, "1"), c(20, "2"), c(35, "3")]);
        assert_eq!((e.kind(), e.lsn()), ("b", 35));
        let Entry::Batch(back) = Entry::decode("b", TL, e.lsn(), &e.encode()).unwrap() else {
            panic!("not a batch")
        };
        let at: Vec<u64> = back.iter().map(|c| c.position.unwrap().lsn.0).collect();
        assert_eq!(at, [10, 20, 35]);
        assert!(
            back.iter()
                .all(|c| c.phase == Phase::Received && c.position.unwrap().timeline == TL)
        );
        assert_eq!(back[1].changes, c(20, "2").changes);
        assert!(Entry::decode("b", TL, 1, "[]").is_err());
        assert!(
            Entry::decode("b", TL, 1, r#"[{"ch":[]}]"#).is_err(),
            "no LSN"
        );
    }

    #[test]
    fn events_round_trip_and_garbage_is_an_error() {
        let r = Entry::Resync(Resync {
            reason: "x".into(),
            scope: Scope::Table(Arc::from("public.t")),
            upto: None,
        });
        match Entry::decode("r", TL, 0, &r.encode()).unwrap() {
            Entry::Resync(r) => assert_eq!(r.scope, Scope::Table(Arc::from("public.t"))),
            e => panic!("{e:?}"),
        }
        let v = Entry::Coverage(Coverage {
            table: Arc::from("public.t"),
            problem: None,
        });
        assert!(
            matches!(Entry::decode("v", TL, 0, &v.encode()).unwrap(), Entry::Coverage(c) if c.problem.is_none())
        );
        let system = u64::MAX - 7;
        let from = Timeline { system, id: 3 };
        let f = Forked {
            from: Server {
                timeline: from,
                started_us: -5,
            },
            fork: Fork {
                from,
                at: Lsn(0x5000_0000),
                to: Timeline { system, id: 4 },
            },
            kept: Lsn(0x4fff_0000),
        };
        let e = Entry::Fork(f);
        assert_eq!(e.lsn(), 0x4fff_0000, "placed where the streams meet");
        match Entry::decode("f", TL, 0, &e.encode()).unwrap() {
            Entry::Fork(back) => assert_eq!(back, f),
            e => panic!("{e:?}"),
        }
        assert!(Entry::decode("f", TL, 0, r#"{"sys":"1","from":1}"#).is_err());
        assert!(Entry::decode("c", TL, 1, "{").is_err());
        assert!(Entry::decode("z", TL, 1, "null").is_err());
        assert!(Entry::decode("c", TL, 1, r#"{"ch":[["t","x",null,null]]}"#).is_err());
    }
}
