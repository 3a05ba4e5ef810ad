//! The write generator: what exists (the shadow), and the next step of
//! the history as SQL with the paths each statement may change.
//!
//! `orders` (a composite key) is written from a stream of its own
//! ([`Gen::orders_rng`], in `ops/orders.rs`): its statements join the steps the main stream
//! makes without changing any of that stream's draws, so every seed, CI's
//! among them, makes the history it made before `orders` existed, with
//! `orders`' writes added.

use std::collections::{BTreeMap, BTreeSet};

use crate::rng::Rng;
use crate::schema::{Path, Res, lit, partition_range};

mod orders;

use orders::{ORDER_NOS, ORDERS_AT_START, OrderOp, TENANTS};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Table {
    Users,
    Docs,
    Tags,
    Events,
    Orders,
}

impl Table {
    /// The tables the main stream draws from; `orders` is drawn from its
    /// own (see the module doc).
    pub const ALL: [Table; 4] = [Table::Users, Table::Docs, Table::Tags, Table::Events];

    pub fn name(self) -> &'static str {
        match self {
            Table::Users => "users",
            Table::Docs => "docs",
            Table::Tags => "tags",
            Table::Events => "events",
            Table::Orders => "orders",
        }
    }
}

#[derive(Clone, Default)]
pub struct Shadow {
    /// id -> email
    pub users: BTreeMap<i64, String>,
    pub docs: BTreeSet<String>,
    pub tags: BTreeSet<String>,
    pub events: BTreeSet<i64>,
    /// `events` partitions attached besides `events_p0`.
    pub attached: Vec<u32>,
    /// Deleted rows whose keys may come back (a negative entry must not
    /// outlive the insert): users (id, email) and tags.
    pub dead_users: Vec<(i64, String)>,
    pub dead_tags: Vec<String>,
    /// `orders`: (tenant_id, order_no).
    pub orders: BTreeSet<(i64, String)>,
    /// Keys of `orders` that had a row (deleted, or moved by a key
    /// update): a revive inserts one again. May hold keys that came back
    /// meanwhile (a key update onto one): skipped then.
    pub dead_orders: Vec<(i64, String)>,
}

impl Shadow {
    /// Every path of a table's current rows.
    pub fn paths(&self, t: Table) -> Vec<Path> {
        match t {
            Table::Users => self
                .users
                .iter()
                .flat_map(|(id, email)| user_paths(*id, email))
                .collect(),
            Table::Docs => self.docs.iter().map(|k| Path::new(Res::Docs, k)).collect(),
            Table::Tags => self.tags.iter().map(|k| Path::new(Res::Tags, k)).collect(),
            Table::Events => self
                .events
                .iter()
                .map(|k| Path::new(Res::Events, k.to_string()))
                .collect(),
            Table::Orders => self
                .orders
                .iter()
                .map(|(t, o)| Path::order(*t, o))
                .collect(),
        }
    }

    pub fn len(&self, t: Table) -> usize {
        match t {
            Table::Users => self.users.len(),
            Table::Docs => self.docs.len(),
            Table::Tags => self.tags.len(),
            Table::Events => self.events.len(),
            Table::Orders => self.orders.len(),
        }
    }

    fn order_rows_of(&self, tenant: i64) -> Vec<(i64, String)> {
        self.orders
            .range((tenant, String::new())..)
            .take_while(|(t, _)| *t == tenant)
            .cloned()
            .collect()
    }
}

pub fn user_paths(id: i64, email: &str) -> [Path; 2] {
    [
        Path::new(Res::Users, id.to_string()),
        Path::new(Res::UsersByEmail, email),
    ]
}

/// One statement and every path it may change.
#[derive(Clone, Debug)]
pub struct Stmt {
    pub sql: String,
    pub paths: Vec<Path>,
}

#[derive(Clone, Debug)]
pub enum Part {
    Stmt(Stmt),
    /// Run after `SAVEPOINT s`, then `ROLLBACK TO SAVEPOINT s`.
    RolledBack(Vec<Stmt>),
}

#[derive(Clone, Debug)]
pub enum End {
    Commit,
    /// `PREPARE TRANSACTION`, a pause, then `COMMIT PREPARED` or
    /// `ROLLBACK PREPARED`.
    Prepared {
        gid: String,
        commit: bool,
    },
}

/// One transaction of the history.
#[derive(Clone, Debug)]
pub struct Step {
    pub kind: &'static str,
    pub parts: Vec<Part>,
    pub end: End,
}

impl Step {
    pub fn paths(&self) -> Vec<Path> {
        let mut out = Vec::new();
        for p in &self.parts {
            match p {
                Part::Stmt(s) => out.extend(s.paths.iter().cloned()),
                Part::RolledBack(ss) => {
                    for s in ss {
                        out.extend(s.paths.iter().cloned())
                    }
                }
            }
        }
        out.sort();
        out.dedup();
        out
    }
}

/// Steps a fault asks for next, so that it has something to miss.
#[derive(Clone, Debug)]
pub enum Focus {
    /// Update these (cached) rows' values, one a step; users' emails too
    /// when `emails`. `orders` rows among them are written by the orders
    /// stream (see [`OrdersFocus::Rows`]).
    Update { paths: Vec<Path>, emails: bool },
    /// Single-row inserts (`orders` too).
    Inserts,
    /// Writes on this table.
    Table(Table),
}

/// What the orders stream writes next, for a fault.
#[derive(Clone, Debug)]
pub enum OrdersFocus {
    /// These (cached) rows, one a step: a value update, a key update of
    /// one part (the cached key must go 404), or a delete.
    Rows(Vec<(i64, String)>),
    /// Single-row inserts.
    Inserts,
    /// Any write on `orders` (the publication without it).
    Writes,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Insert,
    Value,
    Key,
    Delete,
    Revive,
}

pub struct Gen {
    pub rng: Rng,
    pub shadow: Shadow,
    /// Source of fresh keys and values: never reused, so a key is new
    /// unless revived on purpose.
    counter: u64,
    pub prepared_ok: bool,
    /// (what, steps left)
    focus: Option<(Focus, usize)>,
    /// Names prepared transactions uniquely on the cluster.
    pub gid_prefix: String,
    /// Every choice about `orders` (see the module doc): which steps
    /// write it and how, which of its rows a fault caches, whether a
    /// fault on tables includes it.
    pub orders_rng: Rng,
    /// `orders`' source of fresh values and keys.
    orders_counter: u64,
    orders_focus: Option<(OrdersFocus, usize)>,
}

impl Gen {
    pub fn new(rng: Rng, orders_rng: Rng, gid_prefix: String) -> Self {
        Gen {
            rng,
            shadow: Shadow::default(),
            counter: 0,
            prepared_ok: true,
            focus: None,
            gid_prefix,
            orders_rng,
            orders_counter: 0,
            orders_focus: None,
        }
    }

    /// The main stream's focus; `orders` rows among the paths to update,
    /// and inserts, are the orders stream's focus too (taken out of the
    /// main one, which skipped them: its draws are as they were).
    pub fn focus(&mut self, f: Focus, steps: usize) {
        let f = match f {
            Focus::Update { paths, emails } => {
                let (orders, paths): (Vec<Path>, Vec<Path>) =
                    paths.into_iter().partition(|p| p.res == Res::Orders);
                if !orders.is_empty() {
                    let rows = orders.iter().map(Path::order_key).collect();
                    self.focus_orders(OrdersFocus::Rows(rows), steps);
                }
                Focus::Update { paths, emails }
            }
            Focus::Inserts => {
                self.focus_orders(OrdersFocus::Inserts, steps);
                Focus::Inserts
            }
            f => f,
        };
        self.focus = Some((f, steps));
    }

    pub fn focus_orders(&mut self, f: OrdersFocus, steps: usize) {
        self.orders_focus = Some((f, steps));
    }

    fn fresh(&mut self) -> u64 {
        self.counter += 1;
        self.counter
    }

    /// The rows that exist before the gateway starts.
    pub fn initial(&mut self, per_table: usize) -> Vec<Stmt> {
        let mut out = Vec::new();
        for t in Table::ALL {
            out.push(self.bulk(t, per_table));
        }
        let rows: Vec<(i64, String)> = ORDERS_AT_START
            .iter()
            .map(|(t, o)| (*t, o.to_string()))
            .collect();
        let n = per_table.saturating_sub(rows.len());
        out.push(self.orders_insert(rows, n));
        out
    }

    /// The next transaction: the main stream's, and maybe a write on
    /// `orders` among its statements.
    pub fn step(&mut self) -> Step {
        let mut step = self.main_step();
        self.with_orders(&mut step);
        step
    }

    fn main_step(&mut self) -> Step {
        if let Some((focus, left)) = self.focus.take() {
            if left > 1 {
                self.focus = Some((focus.clone(), left - 1));
            }
            if let Some(s) = self.focused(focus) {
                return s;
            }
        }
        let prepared = if self.prepared_ok { 10 } else { 0 };
        match self.rng.weighted(&[55, 12, 10, prepared, 8, 2, 3]) {
            0 => {
                let s = self.any_stmt();
                one("single", s)
            }
            1 => {
                let n = self.rng.range(2, 4);
                let parts = (0..n).map(|_| Part::Stmt(self.any_stmt())).collect();
                Step {
                    kind: "multi",
                    parts,
                    end: End::Commit,
                }
            }
            2 => {
                let before = Part::Stmt(self.any_stmt());
                // What the rolled-back statements do is undone: generated
                // on a copy of the shadow, which is then thrown away.
                let kept = self.shadow.clone();
                let n = self.rng.range(1, 3);
                let undone = (0..n).map(|_| self.any_stmt()).collect();
                self.shadow = kept;
                let after = Part::Stmt(self.any_stmt());
                Step {
                    kind: "savepoint",
                    parts: vec![before, Part::RolledBack(undone), after],
                    end: End::Commit,
                }
            }
            3 => {
                let commit = !self.rng.chance(15);
                let kept = self.shadow.clone();
                let n = self.rng.range(1, 3);
                let parts = (0..n).map(|_| Part::Stmt(self.any_stmt())).collect();
                if !commit {
                    self.shadow = kept;
                }
                let c = self.fresh();
                let gid = format!("{}_{c}", self.gid_prefix);
                Step {
                    kind: "prepared",
                    parts,
                    end: End::Prepared { gid, commit },
                }
            }
            4 => {
                let t = *self.rng.pick(&Table::ALL);
                let n = self.rng.range(5, 30);
                one("bulk", self.bulk(t, n))
            }
            5 => {
                let t = *self.rng.pick(&Table::ALL);
                one("truncate", self.truncate(t))
            }
            _ => {
                let t = if self.rng.chance(50) {
                    Table::Users
                } else {
                    Table::Tags
                };
                let s = self.stmt(t, Kind::Revive);
                one("revive", s)
            }
        }
    }

    fn focused(&mut self, focus: Focus) -> Option<Step> {
        match focus {
            Focus::Update { paths, emails } => {
                // The first of them that still exists.
                for p in paths {
                    let s = match p.res {
                        Res::Users => {
                            let id: i64 = p.key.parse().unwrap();
                            if !self.shadow.users.contains_key(&id) {
                                continue;
                            }
                            if emails {
                                self.user_email(id)
                            } else {
                                self.user_value(id)
                            }
                        }
                        Res::UsersByEmail => {
                            let Some(id) = self
                                .shadow
                                .users
                                .iter()
                                .find(|(_, e)| **e == p.key)
                                .map(|(id, _)| *id)
                            else {
                                continue;
                            };
                            if emails {
                                self.user_email(id)
                            } else {
                                self.user_value(id)
                            }
                        }
                        Res::Docs if self.shadow.docs.contains(&p.key) => {
                            self.value_of(Table::Docs, p.key.clone())
                        }
                        Res::Tags if self.shadow.tags.contains(&p.key) => {
                            self.value_of(Table::Tags, p.key.clone())
                        }
                        Res::Events if self.shadow.events.contains(&p.key.parse().unwrap()) => {
                            self.value_of(Table::Events, p.key.clone())
                        }
                        _ => continue,
                    };
                    // Done with this one: the rest are left for the next
                    // steps (the focus is kept while it has some).
                    if let Some((Focus::Update { paths, .. }, _)) = &mut self.focus {
                        paths.retain(|q| *q != p);
                    }
                    return Some(one("focused", s));
                }
                self.focus = None;
                None
            }
            Focus::Inserts => {
                let t = *self.rng.pick(&Table::ALL);
                let s = self.stmt(t, Kind::Insert);
                Some(one("focused", s))
            }
            Focus::Table(t) => {
                let kind = *self
                    .rng
                    .pick(&[Kind::Insert, Kind::Value, Kind::Key, Kind::Delete]);
                let s = self.stmt(t, kind);
                Some(one("focused", s))
            }
        }
    }

    fn any_stmt(&mut self) -> Stmt {
        let t = *self.rng.pick(&Table::ALL);
        let kind = [Kind::Insert, Kind::Value, Kind::Key, Kind::Delete]
            [self.rng.weighted(&[30, 30, 12, 15])];
        self.stmt(t, kind)
    }

    /// A statement of `kind` on `t`; an insert when `t` is too empty for
    /// anything else (or nothing is there to revive).
    fn stmt(&mut self, t: Table, kind: Kind) -> Stmt {
        if t == Table::Orders {
            let op = match kind {
                Kind::Insert => OrderOp::Insert,
                Kind::Value => OrderOp::Value,
                Kind::Key if self.orders_rng.chance(50) => OrderOp::Tenant,
                Kind::Key => OrderOp::OrderNo,
                Kind::Delete => OrderOp::Delete,
                Kind::Revive => OrderOp::Revive,
            };
            return self.order_stmt(op);
        }
        let kind = if kind != Kind::Insert && kind != Kind::Revive && self.shadow.len(t) < 5 {
            Kind::Insert
        } else {
            kind
        };
        match (t, kind) {
            (_, Kind::Insert) => self.bulk(t, 1),
            (Table::Users, Kind::Revive) if !self.shadow.dead_users.is_empty() => {
                let i = self.rng.below(self.shadow.dead_users.len());
                let (id, email) = self.shadow.dead_users.swap_remove(i);
                let c = self.fresh();
                self.shadow.users.insert(id, email.clone());
                Stmt {
                    sql: format!(
                        "INSERT INTO users (id, email, name) VALUES ({id}, {}, 'revived {c}')",
                        lit(&email)
                    ),
                    paths: user_paths(id, &email).to_vec(),
                }
            }
            (Table::Tags, Kind::Revive) if !self.shadow.dead_tags.is_empty() => {
                let i = self.rng.below(self.shadow.dead_tags.len());
                let code = self.shadow.dead_tags.swap_remove(i);
                let c = self.fresh();
                self.shadow.tags.insert(code.clone());
                Stmt {
                    sql: format!(
                        "INSERT INTO tags (code, label, rev) VALUES ({}, 'revived', {c})",
                        lit(&code)
                    ),
                    paths: vec![Path::new(Res::Tags, code)],
                }
            }
            (_, Kind::Revive) => self.bulk(t, 1),
            (Table::Users, Kind::Value) => {
                let id = self.pick_user();
                self.user_value(id)
            }
            (Table::Users, Kind::Key) => {
                let id = self.pick_user();
                if self.rng.chance(50) {
                    self.user_email(id)
                } else {
                    let email = self.shadow.users.remove(&id).unwrap();
                    let new = 1000 + self.fresh() as i64;
                    self.shadow.users.insert(new, email.clone());
                    let mut paths = user_paths(id, &email).to_vec();
                    paths.push(Path::new(Res::Users, new.to_string()));
                    Stmt {
                        sql: format!("UPDATE users SET id = {new} WHERE id = {id}"),
                        paths,
                    }
                }
            }
            (Table::Users, Kind::Delete) => {
                let id = self.pick_user();
                let email = self.shadow.users.remove(&id).unwrap();
                self.shadow.dead_users.push((id, email.clone()));
                Stmt {
                    sql: format!("DELETE FROM users WHERE id = {id}"),
                    paths: user_paths(id, &email).to_vec(),
                }
            }
            (_, Kind::Value) => {
                let key = self.pick_key(t);
                self.value_of(t, key)
            }
            (_, Kind::Key) => {
                let key = self.pick_key(t);
                let (new, new_lit) = self.new_key(t);
                let old_lit = self.key_lit(t, &key);
                let res = single_res(t);
                self.remove_key(t, &key);
                self.add_key(t, &new);
                Stmt {
                    sql: format!(
                        "UPDATE {} SET {k} = {new_lit} WHERE {k} = {old_lit}",
                        t.name(),
                        k = res.key()
                    ),
                    paths: vec![Path::new(res, key), Path::new(res, new)],
                }
            }
            (_, Kind::Delete) => {
                let key = self.pick_key(t);
                let old_lit = self.key_lit(t, &key);
                let res = single_res(t);
                self.remove_key(t, &key);
                if t == Table::Tags {
                    self.shadow.dead_tags.push(key.clone());
                }
                Stmt {
                    sql: format!("DELETE FROM {} WHERE {} = {old_lit}", t.name(), res.key()),
                    paths: vec![Path::new(res, key)],
                }
            }
        }
    }

    fn pick_user(&mut self) -> i64 {
        let i = self.rng.below(self.shadow.users.len());
        *self.shadow.users.keys().nth(i).unwrap()
    }

    fn pick_key(&mut self, t: Table) -> String {
        let n = self.shadow.len(t);
        let i = self.rng.below(n);
        match t {
            Table::Users => self.shadow.users.keys().nth(i).unwrap().to_string(),
            Table::Docs => self.shadow.docs.iter().nth(i).unwrap().clone(),
            Table::Tags => self.shadow.tags.iter().nth(i).unwrap().clone(),
            Table::Events => self.shadow.events.iter().nth(i).unwrap().to_string(),
            Table::Orders => unreachable!("orders keys are (tenant_id, order_no)"),
        }
    }

    fn user_value(&mut self, id: i64) -> Stmt {
        let c = self.fresh();
        let email = &self.shadow.users[&id];
        Stmt {
            sql: format!("UPDATE users SET name = 'name {c}' WHERE id = {id}"),
            paths: user_paths(id, email).to_vec(),
        }
    }

    fn user_email(&mut self, id: i64) -> Stmt {
        let c = self.fresh();
        let new = format!("e{c}@x.org");
        let old = self.shadow.users.insert(id, new.clone()).unwrap();
        let mut paths = user_paths(id, &old).to_vec();
        paths.push(Path::new(Res::UsersByEmail, new.clone()));
        Stmt {
            sql: format!("UPDATE users SET email = {} WHERE id = {id}", lit(&new)),
            paths,
        }
    }

    fn value_of(&mut self, t: Table, key: String) -> Stmt {
        let c = self.fresh();
        let res = single_res(t);
        let col = match t {
            Table::Docs => "title",
            Table::Tags => "label",
            _ => "kind",
        };
        let key_lit = self.key_lit(t, &key);
        Stmt {
            sql: format!(
                "UPDATE {} SET {col} = 'v{c}', rev = rev + 1 WHERE {} = {key_lit}",
                t.name(),
                res.key()
            ),
            paths: vec![Path::new(res, key)],
        }
    }

    /// `n` new rows in one statement.
    fn bulk(&mut self, t: Table, n: usize) -> Stmt {
        if t == Table::Orders {
            return self.orders_insert(Vec::new(), n);
        }
        let mut values = Vec::new();
        let mut paths = Vec::new();
        for _ in 0..n {
            let c = self.fresh();
            match t {
                Table::Users => {
                    let id = 1000 + c as i64;
                    let email = format!("u{c}@x.org");
                    values.push(format!("({id}, {}, 'user {c}')", lit(&email)));
                    paths.extend(user_paths(id, &email));
                    self.shadow.users.insert(id, email);
                }
                _ => {
                    let (key, key_lit) = self.new_key(t);
                    values.push(format!("({key_lit}, 'new {c}', {c})"));
                    paths.push(Path::new(single_res(t), key.clone()));
                    self.add_key(t, &key);
                }
            }
        }
        let cols = match t {
            Table::Users => "id, email, name",
            Table::Docs => "id, title, rev",
            Table::Tags => "code, label, rev",
            Table::Events => "id, kind, rev",
            Table::Orders => unreachable!("orders: Gen::orders_insert"),
        };
        Stmt {
            sql: format!(
                "INSERT INTO {} ({cols}) VALUES {}",
                t.name(),
                values.join(", ")
            ),
            paths,
        }
    }

    fn truncate(&mut self, t: Table) -> Stmt {
        let paths = self.shadow.paths(t);
        match t {
            Table::Users => {
                let gone = std::mem::take(&mut self.shadow.users);
                self.shadow.dead_users.extend(gone);
            }
            Table::Docs => self.shadow.docs.clear(),
            Table::Tags => {
                let gone = std::mem::take(&mut self.shadow.tags);
                self.shadow.dead_tags.extend(gone);
            }
            Table::Events => self.shadow.events.clear(),
            Table::Orders => {
                let gone = std::mem::take(&mut self.shadow.orders);
                self.shadow.dead_orders.extend(gone);
            }
        }
        Stmt {
            sql: format!("TRUNCATE {}", t.name()),
            paths,
        }
    }

    /// A key never used before, and its literal.
    fn new_key(&mut self, t: Table) -> (String, String) {
        let c = self.fresh();
        match t {
            Table::Users => unreachable!("users keys are made in place"),
            Table::Orders => unreachable!("orders keys: Gen::new_order_key"),
            Table::Docs => {
                let a = self.rng.next_u64();
                let b = self.rng.next_u64();
                // Version 4, variant 1, as gen_random_uuid() makes them.
                let b = (b & 0x3fff_ffff_ffff_ffff) | 0x8000_0000_0000_0000;
                let a = (a & 0xffff_ffff_ffff_0fff) | 0x0000_0000_0000_4000;
                let u = uuid::Uuid::from_u64_pair(a, b).to_string();
                (u.clone(), format!("'{u}'"))
            }
            Table::Tags => {
                let k = text_key(&mut self.rng, c);
                let l = lit(&k);
                (k, l)
            }
            Table::Events => {
                // Into a random partition that is attached.
                let mut parts = vec![0u32];
                parts.extend(self.shadow.attached.iter().copied());
                let p = *self.rng.pick(&parts);
                let id = partition_range(p).0 + c as i64;
                (id.to_string(), id.to_string())
            }
        }
    }

    fn key_lit(&self, t: Table, key: &str) -> String {
        match t {
            Table::Tags | Table::Docs => lit(key),
            _ => key.to_string(),
        }
    }

    fn remove_key(&mut self, t: Table, key: &str) {
        match t {
            Table::Docs => assert!(self.shadow.docs.remove(key)),
            Table::Tags => assert!(self.shadow.tags.remove(key)),
            Table::Events => assert!(self.shadow.events.remove(&key.parse().unwrap())),
            Table::Users | Table::Orders => unreachable!(),
        }
    }

    fn add_key(&mut self, t: Table, key: &str) {
        match t {
            Table::Docs => assert!(self.shadow.docs.insert(key.to_string())),
            Table::Tags => assert!(self.shadow.tags.insert(key.to_string())),
            Table::Events => assert!(self.shadow.events.insert(key.parse().unwrap())),
            Table::Users | Table::Orders => unreachable!(),
        }
    }

    /// A new `events` partition `n` holding a few rows, attached: the
    /// statements that make and fill it (outside any transaction), and the
    /// step that attaches it, which makes its rows appear.
    pub fn attach(&mut self, n: u32) -> (String, String, Step) {
        let (lo, hi) = partition_range(n);
        let mut values = Vec::new();
        let mut paths = Vec::new();
        for _ in 0..self.rng.range(3, 12) {
            let c = self.fresh();
            let id = lo + c as i64;
            values.push(format!("({id}, 'attached {c}', {c})"));
            paths.push(Path::new(Res::Events, id.to_string()));
            self.shadow.events.insert(id);
        }
        self.shadow.attached.push(n);
        let create = format!("CREATE TABLE events_p{n} (LIKE events)");
        let fill = format!(
            "INSERT INTO events_p{n} (id, kind, rev) VALUES {}",
            values.join(", ")
        );
        let attach = Stmt {
            sql: format!(
                "ALTER TABLE events ATTACH PARTITION events_p{n} FOR VALUES FROM ({lo}) TO ({hi})"
            ),
            paths,
        };
        (create, fill, one("attach", attach))
    }

    /// Detaches an attached partition (its rows disappear from `events`):
    /// its number and the step.
    pub fn detach(&mut self) -> (u32, Step) {
        let i = self.rng.below(self.shadow.attached.len());
        let n = self.shadow.attached.swap_remove(i);
        let (lo, hi) = partition_range(n);
        let keys: Vec<i64> = self.shadow.events.range(lo..hi).copied().collect();
        for k in &keys {
            self.shadow.events.remove(k);
        }
        let detach = Stmt {
            sql: format!("ALTER TABLE events DETACH PARTITION events_p{n}"),
            paths: keys
                .iter()
                .map(|k| Path::new(Res::Events, k.to_string()))
                .collect(),
        };
        (n, one("detach", detach))
    }

    /// Keys of each resource that no statement will ever write: probes
    /// that must answer 404 throughout.
    pub fn absent(&mut self, per_res: usize) -> Vec<Path> {
        let mut out = Vec::new();
        for i in 0..per_res {
            out.push(Path::new(Res::Users, (500_000 + i).to_string()));
            out.push(Path::new(Res::UsersByEmail, format!("absent{i}@x.org")));
            let (doc, _) = self.new_key(Table::Docs);
            out.push(Path::new(Res::Docs, doc));
            out.push(Path::new(Res::Tags, format!("absent {i}")));
            // Beyond every partition the history can attach.
            out.push(Path::new(Res::Events, (900_000_000 + i).to_string()));
            // A tenant never drawn with an order number that is; a tenant
            // that is with an order number never made (no `#`).
            out.push(Path::order(
                900_000_000 + i as i64,
                ORDER_NOS[i % ORDER_NOS.len()],
            ));
            out.push(Path::order(
                TENANTS[i % TENANTS.len()],
                &format!("absent {i}/%"),
            ));
        }
        out
    }
}

fn one(kind: &'static str, s: Stmt) -> Step {
    Step {
        kind,
        parts: vec![Part::Stmt(s)],
        end: End::Commit,
    }
}

fn single_res(t: Table) -> Res {
    match t {
        Table::Users => Res::Users,
        Table::Docs => Res::Docs,
        Table::Tags => Res::Tags,
        Table::Events => Res::Events,
        Table::Orders => Res::Orders,
    }
}

/// A text key: mostly ASCII, sometimes spaces, `%`, `/`, `+` or letters
/// outside ASCII (each must survive percent-encoding to the same key);
/// the counter after the last `#` makes it unique.
fn text_key(rng: &mut Rng, c: u64) -> String {
    const PLAIN: &[char] = &['a', 'b', 'k', 'x', 'z', '0', '7', '-', '_', '.'];
    const ODD: &[char] = &[' ', '%', '/', '+', 'é', 'ß', '日', '~', ':', '@'];
    let n = rng.range(1, 8);
    let mut s = String::new();
    for _ in 0..n {
        let set = if rng.chance(15) { ODD } else { PLAIN };
        s.push(*rng.pick(set));
    }
    format!("{s}#{c}")
}
