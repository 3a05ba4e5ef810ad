//! What the WAL feed depends on besides its stream, checked at each
//! session's start and every [`CHECK_EVERY`] while it streams (see "The
//! principle" in [`crate::feed`]): the publication
//! ([`crate::db::publication`]) and the watched tables
//! ([`crate::feed::tracker`]).

use std::sync::atomic::Ordering;

use sqlx::PgConnection;

use super::{Feed, SessionError};
use crate::db::publication::{self, InstallError};
use crate::feed::{Coverage, Event, Resync};

/// Checks, repairs the publication where `database.install_feed` allows
/// (and rescans the tables repaired), and tells the gateway what changed.
/// Err(Wait) when there is no publication to stream from: decoding would
/// fail at the first change, and reconnecting would fail the same way.
pub(super) async fn check(feed: &mut Feed, conn: &mut PgConnection) -> Result<(), SessionError> {
    let watch = feed.watch.clone();
    let publication = feed.opts.publication.clone();
    let mut checked = publication::check(conn, &watch, &publication).await?;
    let mut repaired: Vec<usize> = Vec::new();
    if feed.opts.install && checked.problems.iter().any(Option::is_some) {
        match publication::install(&mut *conn, &watch, &publication).await {
            Ok(()) => {
                feed.stats.repairs.fetch_add(1, Ordering::Relaxed);
                let problems = &checked.problems;
                repaired = (0..problems.len())
                    .filter(|i| problems[*i].is_some())
                    .collect();
                for i in &repaired {
                    tracing::warn!(table = %watch.tables[*i].name, problem = problems[*i].as_deref().unwrap_or_default(), "publication repaired (database.install_feed); the table is rescanned");
                }
                checked = publication::check(conn, &watch, &publication).await?;
            }
            Err(InstallError::Sql(e)) => return Err(e.into()),
            Err(e) => {
                if let Some(not_logged) = feed.throttle.permit() {
                    tracing::error!(error = %e, not_logged, "cannot repair the publication");
                }
            }
        }
    }
    let mut seen = crate::feed::tracker::tables(conn, &watch).await?;
    let prints = publication::fingerprints(conn, &watch, &publication).await?;
    for (s, print) in seen.iter_mut().zip(prints) {
        s.dependency = print;
    }
    let now = seen
        .into_iter()
        .zip(checked.problems)
        .zip(&watch.tables)
        .map(|((seen, problem), t)| {
            let problem = seen.problem(t).or(problem);
            (seen, problem)
        })
        .collect();
    let mut events = feed.tracker.update(&watch, now);
    for i in repaired {
        let name = &watch.tables[i].name;
        let covered = events
            .iter()
            .any(|e| matches!(e, Event::Resync(r) if r.scope.covers(name)));
        if !covered {
            events.push(Resync::table(name.clone(), "the publication was repaired"));
        }
    }
    for e in events {
        if let Event::Coverage(Coverage { table, problem }) = &e {
            match problem {
                Some(p) => {
                    tracing::error!(table = %table, problem = %p, "the WAL feed cannot follow this table: its resources are not ready")
                }
                None => tracing::info!(table = %table, "the WAL feed follows this table again"),
            }
        }
        if feed.tx.send(e).await.is_err() {
            return Ok(());
        }
    }
    if !checked.exists {
        return Err(SessionError::Wait(format!(
            "publication {publication:?} does not exist: run `bloomgate install-feed` (or set database.install_feed = true)"
        )));
    }
    Ok(())
}
