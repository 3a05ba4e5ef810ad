//! Decoding of `pgoutput` messages (protocol versions 1 and 2), the
//! logical decoding output plugin every Postgres since 10 ships.
//!
//! Version 2 (Postgres 14+, with `streaming 'on'`) may send a large
//! transaction in progress, in blocks between Stream Start and Stream Stop,
//! before it commits or aborts; inside a block, every message about a row
//! or relation carries the (sub)transaction's xid after its type byte.
//! Whether a message is inside a block is the reader's state, not the
//! message's: [`decode_in`] takes it.
//!
//! Each message is one byte of type and a body; the decoder reads what the
//! feed needs (transactions, relations, row changes, truncates) and skips
//! the rest. It never panics on malformed input: every read is bounds
//! checked and a short or inconsistent message is a [`DecodeError`]
//! (fuzzed: `fuzz/fuzz_targets/pgoutput_decode.rs`).

use std::fmt;

/// One decoded message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    Begin {
        final_lsn: u64,
        xid: u32,
    },
    Commit {
        commit_lsn: u64,
        end_lsn: u64,
        /// Microseconds since 2000-01-01 (Postgres' epoch).
        commit_time: i64,
    },
    Relation(Relation),
    Insert {
        rel: u32,
        new: Tuple,
    },
    Update {
        rel: u32,
        /// The old row as far as the replica identity carries it: the key
        /// columns ('K') or the whole row ('O'); `None` when no identity
        /// column changed.
        old: Option<Tuple>,
        new: Tuple,
    },
    Delete {
        rel: u32,
        old: Tuple,
    },
    Truncate {
        rels: Vec<u32>,
    },
    /// The transaction came from another node (`O`): replicated by
    /// logical replication into this primary. Still a change to apply.
    Origin {
        lsn: u64,
        name: String,
    },
    /// A user-defined type's name (`Y`), sent before a relation that uses
    /// it. Values reach us as text, so nothing to apply.
    Type {
        id: u32,
        namespace: String,
        name: String,
    },
    /// `pg_logical_emit_message` (`M`), sent only when the `messages`
    /// option is on. Never a row change: nothing to apply, but decoded so
    /// a malformed one is an error rather than silently skipped.
    LogicalMessage {
        transactional: bool,
        lsn: u64,
        prefix: String,
        content: Vec<u8>,
    },
    /// A streamed transaction's block begins (`S`); `first`: its first.
    StreamStart {
        xid: u32,
        first: bool,
    },
    /// The current streamed block ends (`E`).
    StreamStop,
    /// A streamed transaction committed (`c`).
    StreamCommit {
        xid: u32,
        commit_lsn: u64,
        end_lsn: u64,
        /// Microseconds since 2000-01-01.
        commit_time: i64,
    },
    /// A streamed transaction (`subxid == xid`) or one of its
    /// subtransactions aborted (`A`): its changes never happened.
    StreamAbort {
        xid: u32,
        subxid: u32,
    },
    /// A message type this decoder does not know (a newer protocol's):
    /// nothing to apply.
    Other(u8),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Relation {
    pub id: u32,
    pub namespace: String,
    pub name: String,
    pub columns: Vec<String>,
    /// Per column: part of the replica identity (flag bit 1). An old tuple
    /// carries only these; pgoutput sends the others as null, which does
    /// not mean the old value was null. Under REPLICA IDENTITY FULL every
    /// column is flagged.
    pub identity: Vec<bool>,
    /// Per column: its type's OID and modifier.
    pub types: Vec<(u32, i32)>,
}

/// One value per column, in the relation's column order.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Tuple(pub Vec<Datum>);

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Datum {
    Null,
    /// An unchanged TOASTed value: not sent.
    Unchanged,
    /// The type's text output.
    Text(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError(pub &'static str);

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "malformed pgoutput message: {}", self.0)
    }
}

impl std::error::Error for DecodeError {}

struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.buf.len() < n {
            return Err(DecodeError("truncated"));
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_be_bytes(self.take(2)?.try_into().unwrap()))
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_be_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn cstr(&mut self) -> Result<String, DecodeError> {
        let end = self
            .buf
            .iter()
            .position(|&b| b == 0)
            .ok_or(DecodeError("unterminated string"))?;
        let s =
            std::str::from_utf8(&self.buf[..end]).map_err(|_| DecodeError("string not UTF-8"))?;
        self.buf = &self.buf[end + 1..];
        Ok(s.to_string())
    }
    fn tuple(&mut self) -> Result<Tuple, DecodeError> {
        let n = self.u16()?;
        let mut cols = Vec::with_capacity(usize::from(n).min(self.buf.len()));
        for _ in 0..n {
            cols.push(match self.u8()? {
                b'n' => Datum::Null,
                b'u' => Datum::Unchanged,
                b't' => {
                    let len = self.u32()? as usize;
                    let bytes = self.take(len)?;
                    // A SQL_ASCII database can hold any bytes; a key the
                    // gateway serves is UTF-8 (requests are), and another
                    // column's value is never read.
                    Datum::Text(String::from_utf8_lossy(bytes).into_owned())
                }
                _ => return Err(DecodeError("unknown tuple column kind")),
            });
        }
        Ok(Tuple(cols))
    }
}

/// Decodes one message outside a streamed block (all of protocol 1).
pub fn decode(msg: &[u8]) -> Result<Message, DecodeError> {
    decode_in(msg, false).map(|(_, m)| m)
}

/// Decodes one message; `in_stream`: it came between Stream Start and
/// Stream Stop. Returns the (sub)transaction xid such a message carries.
pub fn decode_in(msg: &[u8], in_stream: bool) -> Result<(Option<u32>, Message), DecodeError> {
    let mut r = Reader { buf: msg };
    let kind = r.u8()?;
    let xid = match kind {
        b'R' | b'Y' | b'I' | b'U' | b'D' | b'T' | b'M' if in_stream => Some(r.u32()?),
        _ => None,
    };
    Ok((xid, decode_body(kind, &mut r)?))
}

fn decode_body(kind: u8, r: &mut Reader<'_>) -> Result<Message, DecodeError> {
    Ok(match kind {
        b'B' => {
            let final_lsn = r.u64()?;
            let _commit_time = r.u64()?;
            let xid = r.u32()?;
            Message::Begin { final_lsn, xid }
        }
        b'C' => {
            let _flags = r.u8()?;
            let commit_lsn = r.u64()?;
            let end_lsn = r.u64()?;
            let commit_time = r.u64()? as i64;
            Message::Commit {
                commit_lsn,
                end_lsn,
                commit_time,
            }
        }
        b'R' => {
            let id = r.u32()?;
            let namespace = r.cstr()?;
            let name = r.cstr()?;
            let _identity = r.u8()?;
            let n = r.u16()?;
            let mut columns = Vec::with_capacity(usize::from(n).min(r.buf.len()));
            let mut identity = Vec::with_capacity(usize::from(n).min(r.buf.len()));
            let mut types = Vec::with_capacity(usize::from(n).min(r.buf.len()));
            for _ in 0..n {
                identity.push(r.u8()? & 1 == 1);
                columns.push(r.cstr()?);
                let ty = r.u32()?;
                let typmod = r.u32()? as i32;
                types.push((ty, typmod));
            }
            Message::Relation(Relation {
                id,
                // pgoutput sends "" for pg_catalog; not a table we watch.
                namespace: if namespace.is_empty() {
                    "pg_catalog".into()
                } else {
                    namespace
                },
                name,
                columns,
                identity,
                types,
            })
        }
        b'I' => {
            let rel = r.u32()?;
            if r.u8()? != b'N' {
                return Err(DecodeError("insert without a new tuple"));
            }
            Message::Insert {
                rel,
                new: r.tuple()?,
            }
        }
        b'U' => {
            let rel = r.u32()?;
            let mut old = None;
            let mut tag = r.u8()?;
            if tag == b'K' || tag == b'O' {
                old = Some(r.tuple()?);
                tag = r.u8()?;
            }
            if tag != b'N' {
                return Err(DecodeError("update without a new tuple"));
            }
            Message::Update {
                rel,
                old,
                new: r.tuple()?,
            }
        }
        b'D' => {
            let rel = r.u32()?;
            match r.u8()? {
                b'K' | b'O' => {}
                _ => return Err(DecodeError("delete without an old tuple")),
            }
            Message::Delete {
                rel,
                old: r.tuple()?,
            }
        }
        b'T' => {
            let n = r.u32()?;
            let _options = r.u8()?;
            let mut rels = Vec::with_capacity((n as usize).min(r.buf.len() / 4));
            for _ in 0..n {
                rels.push(r.u32()?);
            }
            Message::Truncate { rels }
        }
        b'O' => Message::Origin {
            lsn: r.u64()?,
            name: r.cstr()?,
        },
        b'Y' => Message::Type {
            id: r.u32()?,
            namespace: r.cstr()?,
            name: r.cstr()?,
        },
        b'M' => {
            let flags = r.u8()?;
            let lsn = r.u64()?;
            let prefix = r.cstr()?;
            let len = r.u32()? as usize;
            let content = r.take(len)?.to_vec();
            Message::LogicalMessage {
                transactional: flags & 1 == 1,
                lsn,
                prefix,
                content,
            }
        }
        b'S' => Message::StreamStart {
            xid: r.u32()?,
            first: r.u8()? == 1,
        },
        b'E' => Message::StreamStop,
        b'c' => {
            let xid = r.u32()?;
            let _flags = r.u8()?;
            Message::StreamCommit {
                xid,
                commit_lsn: r.u64()?,
                end_lsn: r.u64()?,
                commit_time: r.u64()? as i64,
            }
        }
        b'A' => Message::StreamAbort {
            xid: r.u32()?,
            subxid: r.u32()?,
        },
        other => Message::Other(other),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn tuple(cols: &[Option<&str>]) -> Vec<u8> {
        let mut v = (cols.len() as u16).to_be_bytes().to_vec();
        for c in cols {
            match c {
                None => v.push(b'n'),
                Some("\u{1}unchanged") => v.push(b'u'),
                Some(s) => {
                    v.push(b't');
                    v.extend((s.len() as u32).to_be_bytes());
                    v.extend(s.as_bytes());
                }
            }
        }
        v
    }

    #[test]
    fn decodes_what_postgres_sends() {
        let mut begin = vec![b'B'];
        begin.extend(0x1_0000_0010u64.to_be_bytes());
        begin.extend(0u64.to_be_bytes());
        begin.extend(777u32.to_be_bytes());
        assert_eq!(
            decode(&begin).unwrap(),
            Message::Begin {
                final_lsn: 0x1_0000_0010,
                xid: 777
            }
        );

        let mut rel = vec![b'R'];
        rel.extend(16384u32.to_be_bytes());
        rel.extend(b"public\0users\0");
        rel.push(b'd');
        rel.extend(2u16.to_be_bytes());
        for (name, flags) in [("id", 1), ("email", 0)] {
            rel.push(flags);
            rel.extend(name.as_bytes());
            rel.push(0);
            rel.extend(20u32.to_be_bytes());
            rel.extend((-1i32).to_be_bytes());
        }
        match decode(&rel).unwrap() {
            Message::Relation(r) => {
                assert_eq!(
                    (r.id, r.namespace.as_str(), r.name.as_str()),
                    (16384, "public", "users")
                );
                assert_eq!(r.columns, ["id", "email"]);
                assert_eq!(r.identity, [true, false]);
            }
            m => panic!("{m:?}"),
        }

        let mut upd = vec![b'U'];
        upd.extend(16384u32.to_be_bytes());
        upd.push(b'K');
        upd.extend(tuple(&[Some("7"), None]));
        upd.push(b'N');
        upd.extend(tuple(&[Some("7"), Some("\u{1}unchanged")]));
        assert_eq!(
            decode(&upd).unwrap(),
            Message::Update {
                rel: 16384,
                old: Some(Tuple(vec![Datum::Text("7".into()), Datum::Null])),
                new: Tuple(vec![Datum::Text("7".into()), Datum::Unchanged]),
            }
        );

        let mut trunc = vec![b'T'];
        trunc.extend(2u32.to_be_bytes());
        trunc.push(0);
        trunc.extend(1u32.to_be_bytes());
        trunc.extend(2u32.to_be_bytes());
        assert_eq!(
            decode(&trunc).unwrap(),
            Message::Truncate { rels: vec![1, 2] }
        );

        let mut commit = vec![b'C', 0];
        commit.extend(5u64.to_be_bytes());
        commit.extend(9u64.to_be_bytes());
        commit.extend(1u64.to_be_bytes());
        assert_eq!(
            decode(&commit).unwrap(),
            Message::Commit {
                commit_lsn: 5,
                end_lsn: 9,
                commit_time: 1
            }
        );
        // Every strict prefix of a message is an error, never a panic.
        for m in [&begin, &rel, &upd, &trunc, &commit] {
            for n in 1..m.len() {
                assert!(decode(&m[..n]).is_err(), "prefix {n} of {m:?}");
            }
        }
    }

    #[test]
    fn decodes_origin_type_and_logical_message() {
        let mut origin = vec![b'O'];
        origin.extend(0x2_0000_0100u64.to_be_bytes());
        origin.extend(b"node_b\0");
        assert_eq!(
            decode(&origin).unwrap(),
            Message::Origin {
                lsn: 0x2_0000_0100,
                name: "node_b".into()
            }
        );

        let mut ty = vec![b'Y'];
        ty.extend(16500u32.to_be_bytes());
        ty.extend(b"public\0mood\0");
        assert_eq!(
            decode(&ty).unwrap(),
            Message::Type {
                id: 16500,
                namespace: "public".into(),
                name: "mood".into()
            }
        );

        let mut msg = vec![b'M', 1];
        msg.extend(0x30u64.to_be_bytes());
        msg.extend(b"bloomgate\0");
        msg.extend(3u32.to_be_bytes());
        msg.extend(b"hi!");
        assert_eq!(
            decode(&msg).unwrap(),
            Message::LogicalMessage {
                transactional: true,
                lsn: 0x30,
                prefix: "bloomgate".into(),
                content: b"hi!".to_vec()
            }
        );
        // A content length past the end is an error, never a panic or a
        // huge allocation.
        let mut short = vec![b'M', 0];
        short.extend(0x30u64.to_be_bytes());
        short.extend(b"p\0");
        short.extend(u32::MAX.to_be_bytes());
        assert!(decode(&short).is_err());
        // Every prefix of a valid message is an error.
        for m in [&origin, &ty, &msg] {
            for n in 0..m.len() {
                assert!(decode(&m[..n]).is_err(), "{:?}", &m[..n]);
            }
        }
        // An unknown type is skipped, not an error.
        assert_eq!(decode(b"Z").unwrap(), Message::Other(b'Z'));
    }

    #[test]
    fn decodes_streamed_transactions() {
        let mut start = vec![b'S'];
        start.extend(900u32.to_be_bytes());
        start.push(1);
        assert_eq!(
            decode(&start).unwrap(),
            Message::StreamStart {
                xid: 900,
                first: true
            }
        );
        // Inside a block a row message carries its (sub)transaction's xid
        // first; read without that knowledge the relation id would be wrong.
        let mut ins = vec![b'I'];
        ins.extend(901u32.to_be_bytes());
        ins.extend(16384u32.to_be_bytes());
        ins.push(b'N');
        ins.extend(tuple(&[Some("7")]));
        assert_eq!(
            decode_in(&ins, true).unwrap(),
            (
                Some(901),
                Message::Insert {
                    rel: 16384,
                    new: Tuple(vec![Datum::Text("7".into())])
                }
            )
        );
        assert_ne!(
            decode_in(&ins, false).ok().map(|(_, m)| m),
            decode_in(&ins, true).ok().map(|(_, m)| m)
        );
        let mut trunc = vec![b'T'];
        trunc.extend(900u32.to_be_bytes());
        trunc.extend(1u32.to_be_bytes());
        trunc.push(0);
        trunc.extend(5u32.to_be_bytes());
        assert_eq!(
            decode_in(&trunc, true).unwrap(),
            (Some(900), Message::Truncate { rels: vec![5] })
        );
        assert_eq!(decode(b"E").unwrap(), Message::StreamStop);
        let mut commit = vec![b'c'];
        commit.extend(900u32.to_be_bytes());
        commit.push(0);
        commit.extend(5u64.to_be_bytes());
        commit.extend(9u64.to_be_bytes());
        commit.extend(1u64.to_be_bytes());
        assert_eq!(
            decode(&commit).unwrap(),
            Message::StreamCommit {
                xid: 900,
                commit_lsn: 5,
                end_lsn: 9,
                commit_time: 1
            }
        );
        let mut abort = vec![b'A'];
        abort.extend(900u32.to_be_bytes());
        abort.extend(901u32.to_be_bytes());
        assert_eq!(
            decode(&abort).unwrap(),
            Message::StreamAbort {
                xid: 900,
                subxid: 901
            }
        );
        for (m, in_stream) in [
            (&start, false),
            (&ins, true),
            (&trunc, true),
            (&commit, false),
            (&abort, false),
        ] {
            for n in 0..m.len() {
                assert!(decode_in(&m[..n], in_stream).is_err(), "{:?}", &m[..n]);
            }
        }
    }

    proptest! {
        #[test]
        fn never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200), in_stream: bool) {
            let _ = decode_in(&bytes, in_stream);
        }
    }
}
