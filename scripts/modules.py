#!/usr/bin/env python3
"""The module graph of src/: which module uses which, and its cycles.

Checked at two levels, the ones `src/lib.rs` states the layering at:
- the top-level modules (a file or directory directly under src/:
  `config`, `feed`, `db`, ...), each with everything inside it;
- the files inside each directory (`http::admin`, `feed::wal`), among their
  siblings.
An edge A -> B means code of A (its tests excluded) names `crate::B`, or,
for a file in a directory, `super::B`. Exits 1 and prints every cycle (each
strongly connected component of more than one module) if there is one;
`--graph` prints the edges.
"""
import os, re, sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
NESTED = {"http", "feed", "db", "config", "cache", "auth", "resource", "server", "filter"}

def module_of(rel):
    parts = rel[:-3].split(os.sep)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    if not parts:
        return None
    if parts[0] in NESTED and len(parts) > 1:
        return f"{parts[0]}::{parts[1]}"
    return parts[0]

def code_of(text):
    # Leave out `#[cfg(test)]` modules: tests may reach anywhere.
    out, depth, skipping = [], 0, False
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if not skipping and line.strip() == "#[cfg(test)]":
            # skip the following item until its braces balance
            skipping, depth, started = True, 0, False
            i += 1
            while i < len(lines):
                depth += lines[i].count("{") - lines[i].count("}")
                if "{" in lines[i]:
                    started = True
                if started and depth <= 0:
                    break
                if not started and lines[i].rstrip().endswith(";"):
                    break
                i += 1
            skipping = False
            i += 1
            continue
        out.append(re.sub(r"//.*", "", line))
        i += 1
    return "\n".join(out)

modules, edges = set(), set()
files = []
for dirpath, _, names in os.walk(ROOT):
    for n in names:
        if n.endswith(".rs"):
            rel = os.path.relpath(os.path.join(dirpath, n), ROOT)
            files.append(rel)
for rel in files:
    m = module_of(rel)
    if m is None:
        continue
    modules.add(m)
for rel in files:
    m = module_of(rel)
    if m is None:
        continue
    text = code_of(open(os.path.join(ROOT, rel)).read())
    top = m.split("::")[0]
    refs = set()
    for path in re.findall(r"crate::([a-z_]+(?:::[a-z_]+)?)", text):
        a = path.split("::")
        refs.add(f"{a[0]}::{a[1]}" if a[0] in NESTED and len(a) > 1 and f"{a[0]}::{a[1]}" in modules else a[0])
    if "::" in m:
        for sib in re.findall(r"super::([a-z_]+)", text):
            cand = f"{top}::{sib}"
            refs.add(cand if cand in modules else top)
    # `use crate::x::{a, b}` lists
    for base, inner in re.findall(r"crate::([a-z_]+)::\{([^}]*)\}", text):
        for name in re.findall(r"\b([a-z_]+)\b", inner):
            cand = f"{base}::{name}"
            if cand in modules:
                refs.add(cand)
    for r in refs:
        if r not in modules or r == m:
            continue
        # a submodule naming its own parent, or a parent its child, is one unit
        if r == top or r.split("::")[0] == m:
            continue
        edges.add((m, r))

def sccs_of(nodes, edges):
    graph = {m: set() for m in nodes}
    for a, b in edges:
        graph[a].add(b)
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)
    def visit(v):
        index[v] = low[v] = counter[0]; counter[0] += 1
        stack.append(v); on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w); low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == v:
                    break
            out.append(comp)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return [sorted(c) for c in out if len(c) > 1]

top = lambda m: m.split("::")[0]
levels = [("top-level modules", {top(m) for m in modules},
           {(top(a), top(b)) for a, b in edges if top(a) != top(b)})]
for parent in sorted({top(m) for m in modules if "::" in m}):
    nodes = {m for m in modules if m.startswith(parent + "::")}
    levels.append((f"{parent}/", nodes, {(a, b) for a, b in edges if a in nodes and b in nodes}))

if "--graph" in sys.argv:
    for a, b in sorted(edges):
        print(f"{a} -> {b}")
failed = False
for name, nodes, level_edges in levels:
    for c in sccs_of(nodes, level_edges):
        failed = True
        inner = sorted((a, b) for a, b in level_edges if a in c and b in c)
        print(f"cycle among {name} " + ", ".join(c) + ": " + "; ".join(f"{a} -> {b}" for a, b in inner))
sys.exit(1 if failed else 0)
