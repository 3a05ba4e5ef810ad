//! `orders` (a composite key), written from a stream of its own
//! ([`Gen::orders_rng`], see the parent's module doc): which steps write
//! it and how, its keys, and what a fault asks of it.

use super::*;

/// Tenants a new `orders` key part is mostly drawn from: few, so that
/// rows share a tenant or an order number, with digits that run into the
/// order numbers' (`1`/`23` and `12`/`3`: a key whose parts were joined
/// without a boundary would be ambiguous).
pub(super) const TENANTS: [i64; 9] = [1, 2, 3, 12, 23, 31, 123, 0, -1];

/// Order numbers drawn as often as new ones ([`text_key`]): short, digits
/// like the tenants', `/` and `%` (one segment each, percent-encoded;
/// `%2F` must not be decoded twice), a space, non-ASCII.
pub(super) const ORDER_NOS: [&str; 14] = [
    "1", "2", "3", "12", "23", "123", "2/3", "1/23", "/3", "%", "%2F", "a b", "é", "+",
];

/// The rows of `orders` before the first gateway starts, besides random
/// ones: keys whose parts' digits run together alike, each its own row.
pub(super) const ORDERS_AT_START: [(i64, &str); 10] = [
    (1, "23"),
    (12, "3"),
    (123, "1"),
    (31, "2"),
    (1, "2/3"),
    (12, "/3"),
    (2, "%2F"),
    (2, "%"),
    (3, "a b"),
    (-1, "é"),
];

/// A write on `orders`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum OrderOp {
    Insert,
    Bulk,
    Value,
    /// `tenant_id` of one row changed, its `order_no` kept.
    Tenant,
    /// `order_no` of one row changed, its `tenant_id` kept.
    OrderNo,
    Delete,
    Revive,
    /// Every row of a tenant moved to another (one part, several rows).
    MoveTenant,
    DeleteTenant,
    Truncate,
}

/// `orders`, from its own stream.
impl Gen {
    fn orders_fresh(&mut self) -> u64 {
        self.orders_counter += 1;
        self.orders_counter
    }

    /// A write on `orders` joins `step`: what a fault asked for, else
    /// 45 % of the time. Where the step's statements are undone (a
    /// savepoint's, a prepared transaction rolled back), so is its effect
    /// on the shadow.
    pub(super) fn with_orders(&mut self, step: &mut Step) {
        let focused = self.orders_focus.take().map(|(f, left)| {
            if left > 1 {
                self.orders_focus = Some((f.clone(), left - 1));
            }
            f
        });
        let savepoint = step
            .parts
            .iter()
            .position(|p| matches!(p, Part::RolledBack(_)));
        let into_savepoint = focused.is_none() && savepoint.is_some() && self.orders_rng.chance(30);
        if focused.is_none() && !into_savepoint && !self.orders_rng.chance(45) {
            return;
        }
        let undone = into_savepoint || matches!(step.end, End::Prepared { commit: false, .. });
        let kept = undone.then(|| (self.shadow.orders.clone(), self.shadow.dead_orders.clone()));
        let s = match focused {
            Some(f) => self.orders_focused(f),
            None => {
                let op = self.order_op();
                self.order_stmt(op)
            }
        };
        if let Some((orders, dead)) = kept {
            self.shadow.orders = orders;
            self.shadow.dead_orders = dead;
        }
        match savepoint {
            Some(i) if into_savepoint => {
                if let Part::RolledBack(ss) = &mut step.parts[i] {
                    ss.push(s);
                }
            }
            _ => {
                let at = self.orders_rng.below(step.parts.len() + 1);
                step.parts.insert(at, Part::Stmt(s));
            }
        }
    }

    fn orders_focused(&mut self, f: OrdersFocus) -> Stmt {
        match f {
            OrdersFocus::Rows(rows) => {
                // The first of them that still exists; the rest are left
                // for the next steps.
                let Some(row) = rows
                    .iter()
                    .find(|r| self.shadow.orders.contains(r))
                    .cloned()
                else {
                    self.orders_focus = None;
                    let op = self.order_op();
                    return self.order_stmt(op);
                };
                if let Some((OrdersFocus::Rows(rows), _)) = &mut self.orders_focus {
                    rows.retain(|r| *r != row);
                }
                let op = [
                    OrderOp::Value,
                    OrderOp::Tenant,
                    OrderOp::OrderNo,
                    OrderOp::Delete,
                ][self.orders_rng.weighted(&[50, 20, 20, 10])];
                self.order_write(op, row)
            }
            OrdersFocus::Inserts => self.order_stmt(OrderOp::Insert),
            OrdersFocus::Writes => {
                let op = *self.orders_rng.pick(&[
                    OrderOp::Insert,
                    OrderOp::Value,
                    OrderOp::Tenant,
                    OrderOp::OrderNo,
                    OrderOp::Delete,
                ]);
                self.order_stmt(op)
            }
        }
    }

    fn order_op(&mut self) -> OrderOp {
        use OrderOp::*;
        const OPS: [OrderOp; 10] = [
            Insert,
            Bulk,
            Value,
            Tenant,
            OrderNo,
            Delete,
            Revive,
            MoveTenant,
            DeleteTenant,
            Truncate,
        ];
        OPS[self
            .orders_rng
            .weighted(&[22, 3, 25, 13, 13, 11, 7, 3, 2, 1])]
    }

    /// A statement of `op`; an insert when `orders` is too empty for
    /// anything else (or nothing is there to revive).
    pub(super) fn order_stmt(&mut self, op: OrderOp) -> Stmt {
        let small = self.shadow.orders.len() < 5;
        match op {
            OrderOp::Insert => self.orders_insert(Vec::new(), 1),
            OrderOp::Bulk => {
                let n = self.orders_rng.range(3, 12);
                self.orders_insert(Vec::new(), n)
            }
            OrderOp::Revive => {
                while !self.shadow.dead_orders.is_empty() {
                    let i = self.orders_rng.below(self.shadow.dead_orders.len());
                    let row = self.shadow.dead_orders.swap_remove(i);
                    if !self.shadow.orders.contains(&row) {
                        return self.orders_insert(vec![row], 0);
                    }
                }
                self.orders_insert(Vec::new(), 1)
            }
            _ if small => self.orders_insert(Vec::new(), 1),
            OrderOp::Truncate => self.truncate(Table::Orders),
            OrderOp::MoveTenant | OrderOp::DeleteTenant => {
                let (tenant, _) = self.pick_order();
                let rows = self.shadow.order_rows_of(tenant);
                if op == OrderOp::DeleteTenant {
                    for r in &rows {
                        self.shadow.orders.remove(r);
                    }
                    let paths = rows.iter().map(|(t, o)| Path::order(*t, o)).collect();
                    self.shadow.dead_orders.extend(rows);
                    return Stmt {
                        sql: format!("DELETE FROM orders WHERE tenant_id = {tenant}"),
                        paths,
                    };
                }
                // Onto a tenant none of whose order numbers it has.
                let mut to = None;
                for _ in 0..8 {
                    let t = self.new_tenant();
                    let free = rows
                        .iter()
                        .all(|(_, o)| !self.shadow.orders.contains(&(t, o.clone())));
                    if t != tenant && free {
                        to = Some(t);
                        break;
                    }
                }
                let Some(to) = to else {
                    let row = rows[self.orders_rng.below(rows.len())].clone();
                    return self.order_write(OrderOp::Tenant, row);
                };
                let mut paths = Vec::new();
                for (t, o) in rows {
                    paths.push(Path::order(t, &o));
                    paths.push(Path::order(to, &o));
                    self.shadow.orders.remove(&(t, o.clone()));
                    self.shadow.orders.insert((to, o.clone()));
                    self.shadow.dead_orders.push((t, o));
                }
                Stmt {
                    sql: format!("UPDATE orders SET tenant_id = {to} WHERE tenant_id = {tenant}"),
                    paths,
                }
            }
            _ => {
                let row = self.pick_order();
                self.order_write(op, row)
            }
        }
    }

    fn pick_order(&mut self) -> (i64, String) {
        let i = self.orders_rng.below(self.shadow.orders.len());
        self.shadow.orders.iter().nth(i).unwrap().clone()
    }

    /// A write of one existing row: a value, one part of its key, or a
    /// delete.
    fn order_write(&mut self, op: OrderOp, (tenant, order_no): (i64, String)) -> Stmt {
        let at = format!("tenant_id = {tenant} AND order_no = {}", lit(&order_no));
        let old = Path::order(tenant, &order_no);
        match op {
            OrderOp::Value => {
                let c = self.orders_fresh();
                // Sometimes the key's columns set too, to what they are: a
                // change of the value only.
                let same = if self.orders_rng.chance(20) {
                    ", tenant_id = tenant_id, order_no = order_no"
                } else {
                    ""
                };
                Stmt {
                    sql: format!("UPDATE orders SET item = 'v{c}', rev = rev + 1{same} WHERE {at}"),
                    paths: vec![old],
                }
            }
            OrderOp::Tenant | OrderOp::OrderNo => {
                // A key no row has, the other part kept (one that had a
                // row may come back); else one never used.
                let mut new = None;
                for _ in 0..8 {
                    let key = if op == OrderOp::Tenant {
                        (self.new_tenant(), order_no.clone())
                    } else {
                        (tenant, self.new_order_no())
                    };
                    if !self.shadow.orders.contains(&key) {
                        new = Some(key);
                        break;
                    }
                }
                let new = match new {
                    Some(key) => key,
                    None if op == OrderOp::Tenant => {
                        (100_000 + self.orders_fresh() as i64, order_no.clone())
                    }
                    None => {
                        let c = self.orders_fresh();
                        (tenant, text_key(&mut self.orders_rng, c))
                    }
                };
                let set = if op == OrderOp::Tenant {
                    format!("tenant_id = {}", new.0)
                } else {
                    format!("order_no = {}", lit(&new.1))
                };
                let row = (tenant, order_no);
                assert!(self.shadow.orders.remove(&row));
                assert!(self.shadow.orders.insert(new.clone()));
                self.shadow.dead_orders.push(row);
                Stmt {
                    sql: format!("UPDATE orders SET {set} WHERE {at}"),
                    paths: vec![old, Path::order(new.0, &new.1)],
                }
            }
            OrderOp::Delete => {
                let row = (tenant, order_no);
                assert!(self.shadow.orders.remove(&row));
                self.shadow.dead_orders.push(row);
                Stmt {
                    sql: format!("DELETE FROM orders WHERE {at}"),
                    paths: vec![old],
                }
            }
            _ => unreachable!("not a write of one row: {op:?}"),
        }
    }

    /// A tenant for a new key: mostly one of a few, else never used.
    fn new_tenant(&mut self) -> i64 {
        if self.orders_rng.chance(75) {
            *self.orders_rng.pick(&TENANTS)
        } else {
            100_000 + self.orders_fresh() as i64
        }
    }

    /// An order number for a new key: one of a few, or never used.
    fn new_order_no(&mut self) -> String {
        if self.orders_rng.chance(40) {
            self.orders_rng.pick(&ORDER_NOS).to_string()
        } else {
            let c = self.orders_fresh();
            text_key(&mut self.orders_rng, c)
        }
    }

    /// A key no row has now (one that had a row before may come back).
    fn new_order_key(&mut self) -> (i64, String) {
        for _ in 0..8 {
            let key = (self.new_tenant(), self.new_order_no());
            if !self.shadow.orders.contains(&key) {
                return key;
            }
        }
        let tenant = self.new_tenant();
        let c = self.orders_fresh();
        (tenant, text_key(&mut self.orders_rng, c))
    }

    /// One statement inserting `rows` (keys no row has) and `n` new ones.
    pub(super) fn orders_insert(&mut self, mut rows: Vec<(i64, String)>, n: usize) -> Stmt {
        for _ in 0..n {
            let key = self.new_order_key();
            if !rows.contains(&key) {
                rows.push(key);
            }
        }
        let mut values = Vec::new();
        let mut paths = Vec::new();
        for (t, o) in rows {
            let c = self.orders_fresh();
            values.push(format!("({t}, {}, 'new {c}', {c})", lit(&o)));
            paths.push(Path::order(t, &o));
            assert!(self.shadow.orders.insert((t, o)), "a key no row has");
        }
        Stmt {
            sql: format!(
                "INSERT INTO orders (tenant_id, order_no, item, rev) VALUES {}",
                values.join(", ")
            ),
            paths,
        }
    }
}
