#!/usr/bin/env python3
"""bench/report.py: turns bench/run.sh's raw results into the
`## Gateway load test` section of a perf-log entry and an SVG chart.

Standard library only. Reads RESULTS/cells.tsv, RESULTS/preload.tsv,
RESULTS/env.txt and RESULTS/preload-env.txt; writes the entry given by
`--benchmarks` (bench/run.sh: docs/perf-log/YYYY-MM-DD-gateway-load-test.md),
a new file with a title of its own, or, in a file that has one, only its own
section (from its `## Gateway load test` heading to the next `## ` heading),
leaving every other section as it is.

    python3 bench/report.py --results docs/perf-log/results \
        --benchmarks docs/perf-log/YYYY-MM-DD-gateway-load-test.md --svg docs/perf-log/results/loadtest.svg
"""

import argparse
import csv
import datetime
import os
import statistics
import sys
from html import escape

SECTION = "## Gateway load test"
SYSTEMS = ["bloomgate", "bare", "nginx", "varnish", "unprotected"]
WORKLOADS = ["hit", "attack", "hot", "cold", "mixed"]
LABEL = {
    "bloomgate": "bloomgate (shipped config)",
    "bare": "bare axum (ceiling)",
    "nginx": "nginx proxy_cache + unprotected",
    "varnish": "Varnish + unprotected",
    "unprotected": "unprotected (filter, cache off)",
}
COLOR = {
    "bloomgate": "#1f77b4",
    "bare": "#7f7f7f",
    "nginx": "#2ca02c",
    "varnish": "#9467bd",
    "unprotected": "#d62728",
}
P = 0.01  # the false-positive rate the attack target is stated for


def read_tsv(path):
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def read_env(path):
    env = {}
    if os.path.exists(path):
        for line in open(path):
            if "=" in line:
                k, v = line.rstrip("\n").split("=", 1)
                env[k] = v
    return env


def num(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return 0.0


def fmt_int(x):
    return f"{x:,.0f}"


def fmt_ms(us):
    ms = num(us) / 1000
    return f"{ms:.2f}" if ms < 10 else f"{ms:.1f}"


def verdict(ok):
    if ok is None:
        return "**not judged**: a cell was disturbed (see below)"
    return "**met**" if ok else "**not met**"


# Other processes using more than this many cores during a cell's window
# make its requests/s incomparable with another cell's: wrk and the servers
# got a different share of the 2 cores.
DISTURBED_CORES = 0.25


def disturbed(*cs):
    return any(other_cpu(c) / max(num(c["duration_s"]), 1e-9) > DISTURBED_CORES for c in cs)


def rps_verdict(ok, *cs):
    """A request-rate comparison is only judged between undisturbed cells."""
    return None if disturbed(*cs) else ok


def cells_by_key(cells):
    return {(c["system"], c["workload"]): c for c in cells}


def errors(c):
    return int(num(c["socket_errors"]) + num(c["bad_status"]))


def db_per_1k(c):
    r = num(c["requests"])
    return 1000 * num(c["db_queries"]) / r if r else 0.0


def cpu_us(c):
    """Server CPU (utime + stime) per request, in µs: for nginx and Varnish
    their processes plus the gateway behind them."""
    return 1e6 * num(c["server_cpu_s"]) / max(1.0, num(c["requests"]))


def ratio(a, b, fmt="{:.2f}×"):
    return fmt.format(a / b) if b else "–"


def misses_per_1k(c):
    m = c.get("cache_misses")
    if m in (None, "", "-"):
        return "–"
    r = num(c["requests"])
    return f"{1000 * num(m) / r:.1f}" if r else "–"


def check_label(c):
    v = c.get("check") or "-"
    if v == "-":
        return "–"
    if v.startswith("NOT"):
        return f"**{v}**"
    return v


def other_cpu(c):
    """Host CPU during the window not spent by the server, Postgres's bench
    backends or wrk: interference from anything else on the machine."""
    return max(0.0, num(c["host_busy_s"]) - num(c["server_cpu_s"]) - num(c["pg_cpu_s"]) - num(c["wrk_cpu_s"]))


def results_table(cells):
    by = cells_by_key(cells)
    out = [
        "| workload | system | req/s | vs bare | CPU µs / req | CPU vs bare | p50 ms | p99 ms | p99.9 ms | errors "
        "| DB queries / 1k req | cache misses / 1k req | distinct keys | peak RSS MB | Postgres CPU s "
        "| other processes' CPU s | check |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for wl in WORKLOADS:
        bare = by.get(("bare", wl))
        for sysname in SYSTEMS:
            c = by.get((sysname, wl))
            if not c:
                continue
            rps = num(c["rps"])
            vs = f"{100 * rps / num(bare['rps']):.0f} %" if bare and num(bare["rps"]) else "–"
            cpu_vs = ratio(cpu_us(c), cpu_us(bare)) if bare else "–"
            out.append(
                f"| {wl} | {LABEL[sysname]} | {fmt_int(rps)} | {vs} | {cpu_us(c):.1f} | {cpu_vs} "
                f"| {fmt_ms(c['p50_us'])} | {fmt_ms(c['p99_us'])} | {fmt_ms(c['p999_us'])} | {errors(c)} "
                f"| {db_per_1k(c):.1f} | {misses_per_1k(c)} | {fmt_int(num(c['distinct_keys']))} "
                f"| {num(c['peak_rss_kb']) / 1024:.0f} | {num(c['pg_cpu_s']):.1f} | {other_cpu(c):.1f} "
                f"| {check_label(c)} |"
            )
    return out


def preload_summary(rows):
    """(db, mode) -> medians."""
    groups = {}
    for r in rows:
        groups.setdefault((r["keys_db"], r["mode"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        out[key] = {
            "keys": int(num(rs[0]["keys"])),
            "kind": rs[0]["filter_kind"],
            "build_ms": statistics.median(num(r["build_ms"]) for r in rs),
            "ready_ms": statistics.median(num(r["ready_ms"]) for r in rs),
            "rss_mb": statistics.median(num(r["peak_rss_kb"]) for r in rs) / 1024,
            "copy_ms": statistics.median(num(r["copy_ms"]) for r in rs),
            "n": len(rs),
        }
    return out


def db_rows(db):
    return "10M" if "10m" in db else "1M"


def preload_table(summary):
    out = [
        "| table | filter mode | filter | keys | build ms (median) | raw COPY ms (median) | build / COPY "
        "| start to ready ms | peak RSS MB | runs |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (db, mode), s in sorted(summary.items(), key=lambda kv: (kv[0][0], ["auto", "bloom", "off"].index(kv[0][1]) if kv[0][1] in ("auto", "bloom", "off") else 9)):
        if mode == "off":
            out.append(
                f"| {db_rows(db)} users | filter disabled | – | – | – | {fmt_int(s['copy_ms'])} | – "
                f"| {fmt_int(s['ready_ms'])} | {s['rss_mb']:.0f} | {s['n']} |"
            )
            continue
        ratio = s["build_ms"] / s["copy_ms"] if s["copy_ms"] else 0
        mode_label = "auto (shipped)" if mode == "auto" else mode
        out.append(
            f"| {db_rows(db)} users | {mode_label} | {s['kind']} | {fmt_int(s['keys'])} | {fmt_int(s['build_ms'])} "
            f"| {fmt_int(s['copy_ms'])} | {ratio:.2f}× | {fmt_int(s['ready_ms'])} | {s['rss_mb']:.0f} | {s['n']} |"
        )
    return out


def targets(cells, summary):
    by = cells_by_key(cells)
    rows = []

    def cell(s, w):
        return by.get((s, w))

    # Issue 14: the two fast paths against bare axum, in req/s and in CPU.
    for wl, rps_min, cpu_max in (("hit", 0.95, 1.05), ("attack", 0.98, 1.02)):
        g, b = cell("bloomgate", wl), cell("bare", wl)
        if not (g and b):
            continue
        r = num(g["rps"]) / num(b["rps"]) if num(b["rps"]) else 0.0
        rows.append((
            f"{wl}: ≥ {100 * rps_min:.0f} % of bare axum's req/s",
            f"{fmt_int(num(g['rps']))} vs {fmt_int(num(b['rps']))} req/s = {100 * r:.1f} %",
            rps_verdict(r >= rps_min, g, b),
        ))
        cr = cpu_us(g) / cpu_us(b) if cpu_us(b) else float("inf")
        rows.append((
            f"{wl}: gateway CPU per request ≤ {cpu_max:.2f} × bare axum's",
            f"{cpu_us(g):.1f} vs {cpu_us(b):.1f} µs = {cr:.2f}×",
            cr <= cpu_max,
        ))
    g = cell("bloomgate", "hit")
    for other in ("nginx", "varnish"):
        o = cell(other, "hit")
        if g and o and num(o["rps"]):
            r = num(g["rps"]) / num(o["rps"])
            rows.append((
                f"hit: ≥ 1.3 × {LABEL[other].split(' ')[0]}'s req/s",
                f"{fmt_int(num(g['rps']))} vs {fmt_int(num(o['rps']))} req/s = {r:.2f}× "
                f"(CPU µs / req {cpu_us(g):.1f} vs {cpu_us(o):.1f})",
                rps_verdict(r >= 1.3, g, o),
            ))
    for s_ in SYSTEMS:
        c = cell(s_, "hit")
        if c and (c.get("check") or "").startswith("NOT"):
            rows.append((f"hit: {s_} served only cache hits", c["check"], False))
    g = cell("bloomgate", "attack")
    if g:
        limit = 1.5 * P * num(g["requests"])
        ctx = []
        for s in ("nginx", "unprotected"):
            c = cell(s, "attack")
            if c:
                ctx.append(f"{s} {db_per_1k(c):.0f} / 1k")
        rows.append((
            "attack: DB queries ≤ 1.5 × p × requests (p = 0.01)",
            f"{fmt_int(num(g['db_queries']))} queries for {fmt_int(num(g['requests']))} requests "
            f"(limit {fmt_int(limit)}; {db_per_1k(g):.2f} / 1k){'; ' + ', '.join(ctx) if ctx else ''}",
            num(g["db_queries"]) <= limit,
        ))
    g, b, n = cell("bloomgate", "hot"), cell("bare", "hot"), cell("nginx", "hot")
    if g and b:
        ratio = num(g["rps"]) / num(b["rps"])
        rows.append((
            "hot: ≥ 90 % of bare axum's req/s",
            f"{fmt_int(num(g['rps']))} vs {fmt_int(num(b['rps']))} req/s = {100 * ratio:.1f} %",
            rps_verdict(ratio >= 0.90, g, b),
        ))
    if g and n:
        ratio = num(g["rps"]) / num(n["rps"])
        rows.append((
            "hot: ≥ nginx proxy_cache's req/s",
            f"{fmt_int(num(g['rps']))} vs {fmt_int(num(n['rps']))} req/s = {100 * ratio:.0f} %",
            rps_verdict(ratio >= 1.0, g, n),
        ))
    g = cell("bloomgate", "cold")
    if g:
        rows.append((
            "cold: no errors",
            f"{errors(g)} errors (socket errors + statuses other than 200/404) in {fmt_int(num(g['requests']))} requests",
            errors(g) == 0,
        ))
        rows.append((
            "cold: DB queries ≤ 1 per distinct key per TTL (60 s > the window)",
            f"{fmt_int(num(g['db_queries']))} queries for {fmt_int(num(g['distinct_keys']))} distinct keys "
            f"({num(g['db_queries']) / max(1, num(g['distinct_keys'])):.3f} per key)",
            num(g["db_queries"]) <= num(g["distinct_keys"]),
        ))
    for (db, mode), s in sorted(summary.items()):
        if mode != "auto":
            continue
        ratio = s["build_ms"] / s["copy_ms"] if s["copy_ms"] else float("inf")
        rows.append((
            f"preload {db_rows(db)} keys ≤ 1.5 × raw COPY",
            f"{fmt_int(s['build_ms'])} ms vs {fmt_int(s['copy_ms'])} ms = {ratio:.2f}× ({s['kind']} filter, median of {s['n']})",
            ratio <= 1.5,
        ))
    out = ["| target | measured | verdict |", "|---|---|---|"]
    out += [f"| {t} | {m} | {verdict(ok)} |" for t, m, ok in rows]
    upset = [c for c in cells if disturbed(c)]
    if upset:
        worst = max(other_cpu(c) / max(num(c["duration_s"]), 1e-9) for c in upset)
        out += [
            "",
            f"**{len(upset)} of {len(cells)} cells were disturbed**: other processes used more than "
            f"{DISTURBED_CORES} of the 2 cores during their window (up to {worst:.1f} cores; column *other "
            "processes' CPU*), so requests/s are not comparable between cells and the request-rate targets are "
            "not judged. CPU µs per request is the usable figure of such a run (it still rises with contention "
            "for caches and memory bandwidth); rerun on a quiet machine for the rates.",
        ]
    out += ["", *why(by)]
    return out


cpu_per_req = cpu_us


def why(by):
    """Measured context for the request-rate targets, whatever the verdict."""
    notes = []

    def against_bare(g, b):
        return (
            f"the gateway spent {cpu_per_req(g):.1f} µs of CPU per request against bare axum's "
            f"{cpu_per_req(b):.1f} µs ({100 * (cpu_per_req(g) / cpu_per_req(b) - 1):+.0f} %)"
        )

    g, b = by.get(("bloomgate", "hit")), by.get(("bare", "hit"))
    if g and b:
        notes.append(
            f"- *hit*: every request a cache hit ({g.get('check', '?')}); {against_bare(g, b)}: the cost of the "
            "middleware, key parsing, filter, cache read and response headers over a handler that returns a "
            "constant. Where it goes: docs/perf-log/early-where-a-hit-spends-its-time.md."
        )
    g, b = by.get(("bloomgate", "attack")), by.get(("bare", "attack"))
    if g and b:
        notes.append(
            f"- *attack*: {against_bare(g, b)}. With wrk taking "
            f"{num(g['wrk_cpu_s']) / max(num(g['duration_s']), 1e-9):.1f} of the 2 cores, requests/s follow CPU per "
            "request, so the ratio is the per-request overhead of the gateway's middleware, key parsing and filter "
            "over the bare handler."
        )
    g, b = by.get(("bloomgate", "hot")), by.get(("bare", "hot"))
    if g and b:
        miss = num(g["db_queries"]) / max(1.0, num(g["requests"]))
        notes.append(
            f"- *hot*: {100 * miss:.0f} % of the gateway's requests were cache misses, each a Postgres query on the "
            f"same 2 cores; {fmt_int(num(g['distinct_keys']))} distinct keys were asked in the window and "
            f"{fmt_int(num(g['db_queries']))} queries made (no more than one per distinct key: the misses are mostly first requests of a key). "
            "Zipf(1.0) over 1M keys has a long tail: even a perfect 100k-entry LFU cache hits at most "
            "H(100k)/H(1M) ≈ 84 %, and a short run sees more first requests. Bare axum answers every key "
            "from memory."
        )
    g, u = by.get(("bloomgate", "cold")), by.get(("unprotected", "cold"))
    if g and u:
        notes.append(
            f"- *cold*: {cpu_per_req(g):.1f} µs of gateway CPU per request against {cpu_per_req(u):.1f} µs for the "
            f"same binary with filter and cache off ({fmt_int(num(g['rps']))} vs {fmt_int(num(u['rps']))} req/s): "
            "a request that misses the cache costs more than one that never looks."
        )
    return notes


def preload_provenance(preload_env, env):
    """Says so when the preload rows come from another run than the cells."""
    if not preload_env or preload_env.get("run") == env.get("run"):
        return []
    return [
        f"These preload rows were measured {preload_env.get('date', '?')} at commit "
        f"{preload_env.get('git', '?')} on {preload_env.get('cpu', '?')} (kept by `SKIP_PRELOAD=1`), not in the "
        "run of the tables above; compare each row with its own raw COPY time.",
        "",
    ]


def section(cells, summary, env, svg_rel, preload_env=None):
    cmd = env.get("command", "bench/run.sh")
    host_busy = [num(c["host_busy_s"]) for c in cells]
    wrk_cores = [num(c["wrk_cpu_s"]) / max(num(c["duration_s"]), 1e-9) for c in cells]
    dur = [num(c["duration_s"]) for c in cells]
    lines = [
        SECTION,
        "",
        f"Command: `{cmd}` (longer cells: `DURATION=30s bench/run.sh`; see bench/README.md). "
        f"Run {env.get('date', '?')} at commit {env.get('git', '?')}.",
        "",
        f"Machine: {env.get('nproc', '?')} cores (`nproc`), {env.get('cpu', '?')}, {env.get('memory_gb', '?')} GB RAM, "
        f"Linux {env.get('kernel', '?')}; PostgreSQL {env.get('postgres', '?')}, wrk {env.get('wrk', '?')}, nginx {env.get('nginx', '?')}, "
        f"Varnish {env.get('varnish', '?')} (`-s malloc,{env.get('varnish_mem', '?')}`).",
        "",
        f"Each cell: {env.get('warmup', '?')} unmeasured warm-up, then {env.get('duration', '?')} of "
        f"`wrk -t{env.get('threads', '?')} -c{env.get('connections', '?')}` on 127.0.0.1 with the seeded key "
        f"generators of bench/keys.lua (seed {env.get('seed', '?')}): *hit* uniform over "
        f"{fmt_int(num(env.get('hit_keys', '10000')))} existing ids that every system caches, warmed until a pass "
        "over all of them misses nowhere, *attack* 100 % absent ids (1e9..2e9), *hot* "
        "Zipf(1.0) over the 1M existing ids, *cold* uniform over them (10× the cache's 100k entries), "
        "*mixed* 90 % hot + 10 % attack. "
        "**The load generator and the servers share the same 2 cores**: wrk itself uses "
        f"{min(wrk_cores):.1f}–{max(wrk_cores):.1f} cores, so every figure is a ceiling of this box, not of the gateway, and ratios between systems "
        "are compressed towards 1 where the load generator is the bottleneck.",
        "",
        "Errors are socket errors plus statuses other than 200 and 404. DB queries are counted in Postgres "
        "(`idx_scan + seq_scan` of `users` in `pg_stat_user_tables`, read after letting the backends flush "
        "their statistics) over the measured window only. *CPU µs / req* is the utime + stime of the serving "
        "processes over the window (from /proc, children included) divided by the requests wrk completed: "
        "bloomgate, bare and unprotected are one process; nginx is its master and workers plus the unprotected "
        "gateway behind it, Varnish its manager and cache process plus that gateway (Postgres is not "
        "included for anyone: it is its own column). *CPU vs bare* and *vs bare* divide by bare axum's "
        "figure for the same workload. Peak RSS is VmHWM, reset before each "
        "cell (nginx and Varnish: summed over their processes and the backend). Postgres CPU is the gateway's "
        "pooled backends'. *Cache misses* are what each system itself reports as not answered from its "
        "cache (bloomgate: miss + collapsed lookups from its admin API; nginx: non-HIT "
        "`$upstream_cache_status` lines; Varnish: `MAIN.cache_miss` + `MAIN.s_pass`). *check*: a hit cell must "
        "have made no database query (Postgres' count and the gateway's own) and no cache miss. "
        "*Other processes' CPU* is the rest of the host's busy time in the window: anything "
        "else running on the machine (it should be near 0; when it is not, that cell was disturbed).",
        "",
        "### Targets",
        "",
        *targets(cells, summary),
        "",
        "### Results",
        "",
        *results_table(cells),
        "",
        f"![requests/s, p99 latency and database queries per workload and system]({svg_rel})",
        "",
        "### Preload",
        "",
        "Start-up of the gateway against a table of 1M and 10M users, filter mode `auto` (the shipped config, "
        "which picks the exact bitmap for dense integer keys) and `bloom` (forced), against the raw "
        "`COPY (SELECT id FROM users) TO STDOUT` through psql to /dev/null (the floor for streaming the keys; "
        "table pages warm for both). *build ms* is the `duration_ms` of the gateway's `filter built` log "
        "line; *start to ready* is process start to `/readyz` 200; peak RSS is the gateway's VmHWM when ready.",
        "",
        *preload_provenance(preload_env or {}, env),
        *preload_table(summary),
        "",
    ]
    if cells and max(host_busy) > 0:
        lines += [
            f"Host CPU over the measured windows: {min(b / d for b, d in zip(host_busy, dur) if d):.2f}–"
            f"{max(b / d for b, d in zip(host_busy, dur) if d):.2f} cores busy of {env.get('nproc', '?')}; "
            f"load average (1, 5, 15 min) {env.get('loadavg_before', '?')} before the run and "
            f"{env.get('loadavg_after', '?')} after it. "
            f"Raw numbers: docs/perf-log/results/cells.tsv, docs/perf-log/results/preload.tsv, docs/perf-log/results/env.txt.",
            "",
        ]
    return "\n".join(lines)


def replace_section(path, text):
    # Re-read right before writing and touch nothing outside our section.
    try:
        with open(path) as f:
            doc = f.read()
    except FileNotFoundError:
        doc = "# The gateway load test\n\n[The perf log](README.md): list this entry there.\n"
    lines = doc.split("\n")
    start = next((i for i, l in enumerate(lines) if l.strip() == SECTION), None)
    if start is None:
        new = doc.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n"
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        tail = "\n".join(lines[end:])
        new = "\n".join(lines[:start]) + ("\n" if start else "") + text.rstrip("\n") + "\n"
        if tail.strip():
            new += "\n" + tail
    tmp = path + ".tmp-gateway-load-test"
    with open(tmp, "w") as f:
        f.write(new)
    os.replace(tmp, path)


# --- SVG ---------------------------------------------------------------------

def svg_chart(cells):
    by = cells_by_key(cells)
    systems = [s for s in SYSTEMS if any((s, w) in by for w in WORKLOADS)]
    workloads = [w for w in WORKLOADS if any((s, w) in by for s in SYSTEMS)]
    panels = [
        ("requests / s", lambda c: num(c["rps"]), lambda v: f"{v / 1000:.1f}k"),
        ("server CPU µs / request", cpu_us, lambda v: f"{v:.0f}" if v >= 10 else f"{v:.1f}"),
        ("p99 latency, ms", lambda c: num(c["p99_us"]) / 1000, lambda v: f"{v:.1f}"),
        ("DB queries per 1,000 requests", db_per_1k, lambda v: f"{v:.0f}"),
    ]
    pw, ph, top, left, gap = 400, 300, 60, 50, 30
    width = left + len(panels) * (pw + gap)
    height = top + ph + 90
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="22" font-size="15" font-weight="bold">bloomgate load test: {len(systems)} systems × '
        f'{len(workloads)} workloads (wrk on the same 2 cores)</text>',
    ]
    for pi, (title, fn, lab) in enumerate(panels):
        x0 = left + pi * (pw + gap)
        vals = [fn(by[(s, w)]) for s in systems for w in workloads if (s, w) in by]
        vmax = max(vals + [1e-9]) * 1.15
        out.append(f'<text x="{x0 + pw / 2}" y="{top - 12}" text-anchor="middle" font-size="13">{escape(title)}</text>')
        out.append(f'<line x1="{x0}" y1="{top + ph}" x2="{x0 + pw}" y2="{top + ph}" stroke="#333"/>')
        for t in range(5):
            v = vmax * t / 4
            y = top + ph - ph * t / 4
            out.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x0 + pw}" y2="{y:.1f}" stroke="#ddd"/>')
            out.append(f'<text x="{x0 - 4}" y="{y + 4:.1f}" text-anchor="end" fill="#555">{escape(lab(v))}</text>')
        gw = pw / max(1, len(workloads))
        bw = (gw - 14) / max(1, len(systems))
        for wi, w in enumerate(workloads):
            gx = x0 + wi * gw + 7
            out.append(f'<text x="{gx + (gw - 14) / 2:.1f}" y="{top + ph + 16}" text-anchor="middle">{w}</text>')
            for si, s in enumerate(systems):
                c = by.get((s, w))
                if not c:
                    continue
                v = fn(c)
                h = ph * v / vmax
                bx = gx + si * bw
                out.append(
                    f'<rect x="{bx:.1f}" y="{top + ph - h:.1f}" width="{bw - 2:.1f}" height="{max(h, 0.5):.1f}" '
                    f'fill="{COLOR[s]}"><title>{escape(LABEL[s])}, {w}: {escape(lab(v))}</title></rect>'
                )
                out.append(
                    f'<text x="{bx + (bw - 2) / 2:.1f}" y="{top + ph - h - 3:.1f}" text-anchor="middle" '
                    f'font-size="8" fill="#333">{escape(lab(v))}</text>'
                )
    lx = left
    for s in systems:
        out.append(f'<rect x="{lx}" y="{top + ph + 40}" width="12" height="12" fill="{COLOR[s]}"/>')
        out.append(f'<text x="{lx + 16}" y="{top + ph + 50}">{escape(LABEL[s])}</text>')
        lx += 40 + 7 * len(LABEL[s])
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default="docs/perf-log/results")
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    ap.add_argument("--benchmarks", default=f"docs/perf-log/{today}-gateway-load-test.md",
                    help="the perf-log entry to write (default: today's, UTC)")
    ap.add_argument("--svg", default="docs/perf-log/results/loadtest.svg")
    ap.add_argument("--print", action="store_true", help="print the section instead of writing it")
    a = ap.parse_args()
    cells = read_tsv(os.path.join(a.results, "cells.tsv"))
    summary = preload_summary(read_tsv(os.path.join(a.results, "preload.tsv")))
    env = read_env(os.path.join(a.results, "env.txt"))
    if not cells:
        sys.exit("report.py: no cells in " + a.results)
    svg_rel = os.path.relpath(a.svg, os.path.dirname(os.path.abspath(a.benchmarks)) or ".")
    preload_env = read_env(os.path.join(a.results, "preload-env.txt"))
    text = section(cells, summary, env, svg_rel, preload_env)
    if a.print:
        print(text)
        return
    with open(a.svg, "w") as f:
        f.write(svg_chart(cells))
    replace_section(a.benchmarks, text)
    print(f"report.py: wrote {a.svg} and the '{SECTION}' section of {a.benchmarks}", file=sys.stderr)


if __name__ == "__main__":
    main()
