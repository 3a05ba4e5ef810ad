//! Replication commands over the simple query protocol (slot creation,
//! `START_REPLICATION`), and the [`Stream`] of frames that follows, with
//! the standby status updates that acknowledge it.

use std::future::Future;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{BufMut, BytesMut};
use tokio::io::AsyncReadExt;

use super::frame::{Frame, data_row, frame, put_cstr, server_error};
use super::{Connection, ReplError, protocol};
use crate::db::lsn::Lsn;
use crate::db::position::Timeline;

impl Connection {
    /// Runs one command; returns its rows, every field as text (`None`:
    /// NULL).
    pub async fn simple_query(&mut self, sql: &str) -> Result<Vec<Vec<Option<String>>>, ReplError> {
        let mut q = BytesMut::new();
        put_cstr(&mut q, sql);
        self.send(b'Q', &q).await?;
        let mut rows = Vec::new();
        let mut error = None;
        loop {
            let m = self.read().await?;
            match m.tag {
                b'D' => rows.push(data_row(m.body)?),
                b'T' | b'C' | b'I' | b'N' | b'S' => {}
                b'E' => error = Some(server_error(&m.body)),
                b'Z' => {
                    return match error {
                        Some(e) => Err(e),
                        None => Ok(rows),
                    };
                }
                t => {
                    return Err(protocol(format!(
                        "unexpected message {:?} after a query",
                        t as char
                    )));
                }
            }
        }
    }

    /// `IDENTIFY_SYSTEM`: the server's system identifier and the timeline
    /// it is on, as this connection sees them.
    pub async fn identify_system(&mut self) -> Result<Timeline, ReplError> {
        let rows = self.simple_query("IDENTIFY_SYSTEM").await?;
        let field = |i: usize| {
            rows.first()
                .and_then(|r| r.get(i))
                .and_then(|v| v.as_deref())
        };
        let system = field(0).and_then(|v| v.parse().ok());
        let id = field(1).and_then(|v| v.parse().ok());
        match (system, id) {
            (Some(system), Some(id)) => Ok(Timeline { system, id }),
            _ => Err(protocol(
                "IDENTIFY_SYSTEM returned no system identifier or timeline",
            )),
        }
    }

    /// `TIMELINE_HISTORY tli`: the history file of timeline `tli` (for
    /// each earlier timeline of its history, the position where the next
    /// one forked from it), as text. The server sends the file's bytes as
    /// they are; a history file is ASCII.
    pub async fn timeline_history(&mut self, tli: u32) -> Result<String, ReplError> {
        let rows = self
            .simple_query(&format!("TIMELINE_HISTORY {tli}"))
            .await?;
        rows.into_iter()
            .next()
            .and_then(|r| r.into_iter().nth(1).flatten())
            .ok_or_else(|| protocol("TIMELINE_HISTORY returned no content"))
    }

    /// Creates a logical slot with `pgoutput`; returns its consistent
    /// point. A temporary slot lives exactly as long as this connection.
    pub async fn create_slot(&mut self, name: &str, temporary: bool) -> Result<Lsn, ReplError> {
        // The pre-15 spelling (NOEXPORT_SNAPSHOT) is accepted by every
        // version since 10.
        let sql = format!(
            "CREATE_REPLICATION_SLOT {} {}LOGICAL pgoutput NOEXPORT_SNAPSHOT",
            quote_ident(name),
            if temporary { "TEMPORARY " } else { "" }
        );
        let rows = self.simple_query(&sql).await?;
        let point = rows
            .first()
            .and_then(|r| r.get(1))
            .and_then(|v| v.as_deref())
            .and_then(Lsn::parse)
            .ok_or_else(|| protocol("CREATE_REPLICATION_SLOT returned no consistent point"))?;
        Ok(point)
    }

    /// `START_REPLICATION SLOT name LOGICAL start (options)`; `Lsn::ZERO`
    /// starts at the slot's confirmed position.
    pub async fn start(
        mut self,
        slot: &str,
        start: Lsn,
        options: &[(&str, &str)],
    ) -> Result<Stream, ReplError> {
        let opts: Vec<String> = options
            .iter()
            .map(|(k, v)| format!("{} {}", quote_ident(k), quote_literal(v)))
            .collect();
        let sql = format!(
            "START_REPLICATION SLOT {} LOGICAL {} ({})",
            quote_ident(slot),
            start,
            opts.join(", ")
        );
        let mut q = BytesMut::new();
        put_cstr(&mut q, &sql);
        self.send(b'Q', &q).await?;
        loop {
            let m = self.read().await?;
            match m.tag {
                b'W' => break,
                b'N' | b'S' => {}
                b'E' => return Err(server_error(&m.body)),
                t => {
                    return Err(protocol(format!(
                        "unexpected message {:?} after START_REPLICATION",
                        t as char
                    )));
                }
            }
        }
        Ok(Stream { conn: self })
    }
}

/// A replication connection in `CopyBoth` mode.
pub struct Stream {
    conn: Connection,
}

impl Stream {
    /// The next frame, waiting for it.
    pub async fn recv(&mut self) -> Result<Frame, ReplError> {
        loop {
            let m = self.conn.read().await?;
            if let Some(f) = frame(m)? {
                return Ok(f);
            }
        }
    }

    /// The next frame if one has already arrived whole, without waiting.
    pub fn try_recv(&mut self) -> Result<Option<Frame>, ReplError> {
        while let Some(m) = self.conn.buffered()? {
            if let Some(f) = frame(m)? {
                return Ok(Some(f));
            }
        }
        Ok(None)
    }

    /// Reads what the socket holds into the buffer without waiting (so that
    /// [`try_recv`](Self::try_recv) sees frames that arrived meanwhile).
    pub fn fill(&mut self) -> Result<(), ReplError> {
        use std::task::{Context, Poll};
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        for _ in 0..64 {
            let before = self.conn.buf.len();
            if self.conn.buf.capacity() - before < 8192 {
                self.conn.buf.reserve(64 * 1024);
            }
            let fut = self.conn.io.read_buf(&mut self.conn.buf);
            tokio::pin!(fut);
            match fut.as_mut().poll(&mut cx) {
                Poll::Ready(Ok(0)) => {
                    return Err(ReplError::Io(std::io::ErrorKind::UnexpectedEof.into()));
                }
                Poll::Ready(Ok(_)) => continue,
                Poll::Ready(Err(e)) => return Err(e.into()),
                Poll::Pending => return Ok(()),
            }
        }
        Ok(())
    }

    /// A standby status update: received up to `written`, durably applied
    /// up to `flushed` (the slot's confirmed position: the server may
    /// recycle WAL before it).
    pub async fn send_status(
        &mut self,
        written: Lsn,
        flushed: Lsn,
        reply_requested: bool,
    ) -> Result<(), ReplError> {
        let mut b = BytesMut::with_capacity(34);
        b.put_u8(b'r');
        b.put_u64(written.0);
        b.put_u64(flushed.0);
        b.put_u64(flushed.0);
        b.put_i64(pg_now());
        b.put_u8(u8::from(reply_requested));
        self.conn.send(b'd', &b).await
    }
}

/// Microseconds since 2000-01-01, Postgres' clock.
fn pg_now() -> i64 {
    const PG_EPOCH: Duration = Duration::from_secs(946_684_800);
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .ok()
        .and_then(|d| d.checked_sub(PG_EPOCH))
        .map_or(0, |d| d.as_micros() as i64)
}

/// `s` as a quoted SQL identifier.
pub fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

fn quote_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_and_literals_are_quoted() {
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
        assert_eq!(quote_literal("it's"), "'it''s'");
    }
}
