//! Demo data: `bloomgate seed --users N --articles M`.
//!
//! Rows are generated inside Postgres (`generate_series`), so a million rows
//! cost one statement and no network traffic. Keys are deterministic (user
//! `g` has id `g`, article `g` has id `md5('article-g')`), which makes seeding
//! idempotent: running it again inserts only what is missing.

use std::time::{Duration, Instant};

use sqlx::PgPool;

#[derive(Debug)]
pub struct SeedReport {
    pub users_inserted: u64,
    pub articles_inserted: u64,
    pub elapsed: Duration,
}

pub async fn seed(pool: &PgPool, users: u64, articles: u64) -> Result<SeedReport, sqlx::Error> {
    let began = Instant::now();
    let users_i = i64::try_from(users).unwrap_or(i64::MAX);
    let articles_i = i64::try_from(articles).unwrap_or(i64::MAX);
    let mut tx = pool.begin().await?;
    sqlx::query("SET LOCAL statement_timeout = 0")
        .execute(&mut *tx)
        .await?;
    let users_inserted = sqlx::query(
        "INSERT INTO users (id, email, name, created_at)
         SELECT g, 'user' || g || '@example.com', 'User ' || g,
                timestamptz '2024-01-01' + g * interval '1 minute'
         FROM generate_series(1, $1::bigint) AS g
         ON CONFLICT DO NOTHING",
    )
    .bind(users_i)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    // Explicit ids leave the identity sequence behind; move it past them so
    // ordinary inserts keep working.
    sqlx::query(
        "SELECT setval(pg_get_serial_sequence('users', 'id'), GREATEST((SELECT max(id) FROM users), 1))",
    )
    .execute(&mut *tx)
    .await?;
    // Authors are users 1..=N, all present after the insert above.
    let articles_inserted = sqlx::query(
        "INSERT INTO articles (id, author_id, title, body, published_at)
         SELECT md5('article-' || g)::uuid,
                CASE WHEN $2::bigint > 0 THEN 1 + g % $2::bigint END,
                'Article ' || g,
                repeat('Lorem ipsum dolor sit amet. ', 1 + (g % 8)::int),
                timestamptz '2024-01-01' + g * interval '1 hour'
         FROM generate_series(1, $1::bigint) AS g
         ON CONFLICT DO NOTHING",
    )
    .bind(articles_i)
    .bind(users_i)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    sqlx::raw_sql(
        "ALTER TABLE users ENABLE TRIGGER USER; ALTER TABLE articles ENABLE TRIGGER USER;
         SELECT pg_notify('bloomgate', '{\"table\": \"public.users\", \"op\": \"RESCAN\"}');
         SELECT pg_notify('bloomgate', '{\"table\": \"public.articles\", \"op\": \"RESCAN\"}');",
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    sqlx::query("ANALYZE users").execute(pool).await?;
    sqlx::query("ANALYZE articles").execute(pool).await?;
    Ok(SeedReport {
        users_inserted,
        articles_inserted,
        elapsed: began.elapsed(),
    })
}
