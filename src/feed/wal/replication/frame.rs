//! The wire format of the protocol's messages: a type byte, a 32-bit
//! length, a body. Messages are cut out of the received bytes whole, and
//! every field is read with a bounds check: a short or overlong message is
//! a [`ReplError::Protocol`], never a panic.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::{ReplError, protocol};
use crate::db::lsn::Lsn;

/// Longest backend message accepted. A pgoutput message carries a whole
/// row of a published table (every column, unchanged TOASTed values
/// excepted), and the server builds it in one buffer, which Postgres caps at
/// 1 GiB; past that (and the frame's header) it is a broken stream.
pub const MAX_MESSAGE: usize = (1 << 30) + 1024;

/// One backend message: its type byte and body.
pub(super) struct Msg {
    pub(super) tag: u8,
    pub(super) body: Bytes,
}

impl Msg {
    /// Takes the next complete message off the front of `buf`, if it holds
    /// one; reserves room for the rest of one it holds in part.
    pub(super) fn split_off(buf: &mut BytesMut) -> Result<Option<Msg>, ReplError> {
        if buf.len() < 5 {
            return Ok(None);
        }
        let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
        if !(4..=MAX_MESSAGE).contains(&len) {
            return Err(protocol(format!("message length {len} out of range")));
        }
        if buf.len() < len + 1 {
            buf.reserve(len + 1 - buf.len());
            return Ok(None);
        }
        let tag = buf[0];
        let mut m = buf.split_to(len + 1);
        m.advance(5);
        Ok(Some(Msg {
            tag,
            body: m.freeze(),
        }))
    }
}

/// What the server streams after `START_REPLICATION`.
#[derive(Debug, PartialEq, Eq)]
pub enum Frame {
    /// WAL data: one pgoutput message.
    XLogData {
        /// Where the data starts in the WAL.
        start: Lsn,
        /// The server's current end of WAL.
        wal_end: Lsn,
        data: Bytes,
    },
    /// The server is alive; everything before `wal_end` was sent.
    Keepalive { wal_end: Lsn, reply_requested: bool },
    /// The server ended the stream (`CopyDone`).
    End,
}

/// The frame a message in the stream carries; `None` for a notice or a
/// parameter status.
pub(super) fn frame(m: Msg) -> Result<Option<Frame>, ReplError> {
    match m.tag {
        b'd' => {
            let mut b = m.body;
            let kind = get_u8(&mut b)?;
            match kind {
                b'w' => {
                    let start = Lsn(get_u64(&mut b)?);
                    let wal_end = Lsn(get_u64(&mut b)?);
                    let _sent_at = get_u64(&mut b)?;
                    Ok(Some(Frame::XLogData {
                        start,
                        wal_end,
                        data: b,
                    }))
                }
                b'k' => {
                    let wal_end = Lsn(get_u64(&mut b)?);
                    let _sent_at = get_u64(&mut b)?;
                    let reply = get_u8(&mut b)? != 0;
                    Ok(Some(Frame::Keepalive {
                        wal_end,
                        reply_requested: reply,
                    }))
                }
                k => Err(protocol(format!("unknown CopyData kind {:?}", k as char))),
            }
        }
        b'c' => Ok(Some(Frame::End)),
        b'N' | b'S' => Ok(None),
        b'E' => Err(server_error(&m.body)),
        t => Err(protocol(format!(
            "unexpected message {:?} in the stream",
            t as char
        ))),
    }
}

pub(super) fn len32(n: usize) -> Result<u32, ReplError> {
    u32::try_from(n).map_err(|_| protocol("message too long"))
}

pub(super) fn put_cstr(b: &mut BytesMut, s: &str) {
    b.extend_from_slice(s.as_bytes());
    b.put_u8(0);
}

pub(super) fn get_u8(b: &mut Bytes) -> Result<u8, ReplError> {
    if b.is_empty() {
        return Err(protocol("short message"));
    }
    Ok(b.get_u8())
}

pub(super) fn get_u32(b: &mut Bytes) -> Result<u32, ReplError> {
    if b.len() < 4 {
        return Err(protocol("short message"));
    }
    Ok(b.get_u32())
}

pub(super) fn get_u64(b: &mut Bytes) -> Result<u64, ReplError> {
    if b.len() < 8 {
        return Err(protocol("short message"));
    }
    Ok(b.get_u64())
}

pub(super) fn data_row(mut b: Bytes) -> Result<Vec<Option<String>>, ReplError> {
    if b.len() < 2 {
        return Err(protocol("short DataRow"));
    }
    let n = b.get_u16() as usize;
    let mut row = Vec::with_capacity(n);
    for _ in 0..n {
        let len = get_u32(&mut b)? as i32;
        if len < 0 {
            row.push(None);
            continue;
        }
        let len = len as usize;
        if b.len() < len {
            return Err(protocol("short DataRow field"));
        }
        let v = b.split_to(len);
        row.push(Some(String::from_utf8_lossy(&v).into_owned()));
    }
    Ok(row)
}

/// An `ErrorResponse`'s SQLSTATE and message.
pub(super) fn server_error(body: &[u8]) -> ReplError {
    let mut code = String::new();
    let mut message = String::new();
    for field in body.split(|&c| c == 0) {
        let Some((&kind, text)) = field.split_first() else {
            continue;
        };
        match kind {
            b'C' => code = String::from_utf8_lossy(text).into_owned(),
            b'M' => message = String::from_utf8_lossy(text).into_owned(),
            _ => {}
        }
    }
    ReplError::Server { code, message }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(tag: u8, body: &[u8]) -> Msg {
        Msg {
            tag,
            body: Bytes::copy_from_slice(body),
        }
    }

    #[test]
    fn frames_parse_and_short_ones_are_errors() {
        let mut w = vec![b'w'];
        w.extend_from_slice(&0x1_0000_0010u64.to_be_bytes());
        w.extend_from_slice(&0x1_0000_0020u64.to_be_bytes());
        w.extend_from_slice(&0u64.to_be_bytes());
        w.extend_from_slice(b"BEGIN");
        assert_eq!(
            frame(msg(b'd', &w)).unwrap(),
            Some(Frame::XLogData {
                start: Lsn(0x1_0000_0010),
                wal_end: Lsn(0x1_0000_0020),
                data: Bytes::from_static(b"BEGIN"),
            })
        );
        let mut k = vec![b'k'];
        k.extend_from_slice(&7u64.to_be_bytes());
        k.extend_from_slice(&0u64.to_be_bytes());
        k.push(1);
        assert_eq!(
            frame(msg(b'd', &k)).unwrap(),
            Some(Frame::Keepalive {
                wal_end: Lsn(7),
                reply_requested: true
            })
        );
        for cut in 0..k.len() {
            assert!(
                frame(msg(b'd', &k[..cut])).is_err(),
                "keepalive cut at {cut}"
            );
        }
        for cut in 0..25 {
            assert!(
                frame(msg(b'd', &w[..cut])).is_err(),
                "XLogData cut at {cut}"
            );
        }
        assert_eq!(frame(msg(b'c', b"")).unwrap(), Some(Frame::End));
        assert_eq!(frame(msg(b'N', b"")).unwrap(), None);
        assert!(matches!(
            frame(msg(b'E', b"SERROR\0C58P01\0Mslot gone\0\0")),
            Err(ReplError::Server { code, message }) if code == "58P01" && message == "slot gone"
        ));
        assert!(frame(msg(b'd', b"x")).is_err());
    }

    #[test]
    fn data_rows_parse_and_never_overrun() {
        let mut d = vec![0, 2];
        d.extend_from_slice(&3u32.to_be_bytes());
        d.extend_from_slice(b"0/1");
        d.extend_from_slice(&(-1i32).to_be_bytes());
        assert_eq!(
            data_row(Bytes::from(d.clone())).unwrap(),
            vec![Some("0/1".to_string()), None]
        );
        for cut in 0..d.len() {
            assert!(
                data_row(Bytes::copy_from_slice(&d[..cut])).is_err(),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn messages_are_cut_whole_and_bad_lengths_refused() {
        let mut buf = BytesMut::from(&b"Z\0\0\0\x05I"[..]);
        buf.extend_from_slice(b"C\0\0");
        let m = Msg::split_off(&mut buf).unwrap().unwrap();
        assert_eq!((m.tag, &m.body[..]), (b'Z', &b"I"[..]));
        assert!(
            Msg::split_off(&mut buf).unwrap().is_none(),
            "a partial one waits"
        );
        let mut bad = BytesMut::from(&b"Z\0\0\0\x03"[..]);
        assert!(Msg::split_off(&mut bad).is_err());
        let mut huge = BytesMut::from(&b"d\x7f\xff\xff\xff"[..]);
        assert!(Msg::split_off(&mut huge).is_err());
    }
}
