#!/usr/bin/env python3
"""The module graph of src/: which module uses which, and its cycles.

A module is a file or a directory (`feed`, `feed::wal`,
`feed::wal::session`); a file only tests compile (`#[cfg(test)] mod x;`)
is left out, as are `#[cfg(test)]` items inside files. An edge A -> B means code of A (its tests
excluded) names B: `crate::b::…`, `super::…`, `super::super::…` or
`self::…`, in a path or inside a `use` list (`use super::{a, b::C}`; the
braces expanded, however nested). A name resolves to the longest module
path it starts with.

Checked at every level of the tree: for each directory, its direct
children (files and subdirectories, each with everything inside it) form
a graph, an edge between two descendants counting for the two children
that hold them. Exits 1 and prints every cycle (each strongly connected
component of more than one module) at any level; `--graph` prints the
edges.
"""
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")


def module_of(rel):
    parts = rel[:-3].split(os.sep)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return tuple(parts)


def code_of(text):
    """The text without comments and without `#[cfg(test)]` items: tests
    may reach anywhere."""
    text = re.sub(r"//[^\n]*", "", text)
    out, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        if lines[i].strip() == "#[cfg(test)]":
            depth, started = 0, False
            i += 1
            while i < len(lines):
                depth += lines[i].count("{") - lines[i].count("}")
                started = started or "{" in lines[i]
                if (started and depth <= 0) or (not started and lines[i].rstrip().endswith(";")):
                    break
                i += 1
            i += 1
            continue
        out.append(lines[i])
        i += 1
    return "\n".join(out)


def expand(tree):
    """`a::{b, c::{d, e}}` -> ["a::b", "a::c::d", "a::c::e"]."""
    tree = re.sub(r"\s+", "", tree)
    brace = tree.find("{")
    if brace < 0:
        return [tree]
    prefix, depth, parts, start = tree[:brace], 0, [], brace + 1
    for i in range(brace, len(tree)):
        if tree[i] == "{":
            depth += 1
        elif tree[i] == "}":
            depth -= 1
            if depth == 0:
                parts.append(tree[start:i])
                break
        elif tree[i] == "," and depth == 1:
            parts.append(tree[start:i])
            start = i + 1
    return [p for part in parts if part for p in expand(prefix + part)]


def paths_in(text):
    """Every path that starts at `crate`, `super` or `self`."""
    out = []
    for tree in re.findall(r"\buse\s+([^;]+);", text):
        out += [p for p in expand(tree) if re.match(r"(crate|super|self)::", p)]
    out += re.findall(r"(?<![\w:])((?:crate|super|self)(?:::[A-Za-z_]\w*)+)", text)
    return out


def resolve(module, path, modules):
    segments = path.split("::")
    # A module's `super` is its parent, whether it is a file or a mod.rs.
    base = list(module)
    if segments[0] == "crate":
        base, segments = [], segments[1:]
    elif segments[0] == "self":
        base, segments = list(module), segments[1:]
    while segments and segments[0] == "super":
        base = base[:-1]
        segments = segments[1:]
    best = None
    for n in range(len(segments) + 1):
        candidate = tuple(base + segments[:n])
        if candidate in modules:
            best = candidate
    return best


files = []
for dirpath, _, names in os.walk(ROOT):
    files += [os.path.relpath(os.path.join(dirpath, n), ROOT) for n in names if n.endswith(".rs")]
# A file only tests compile (`#[cfg(test)] mod reference;`) is a test.
test_only = set()
for rel in files:
    text = open(os.path.join(ROOT, rel)).read()
    for name in re.findall(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", text):
        test_only.add(module_of(rel) + (name,))
files = [rel for rel in files if not any(module_of(rel)[: len(t)] == t for t in test_only)]
modules = {module_of(rel) for rel in files}
edges = set()
for rel in files:
    m = module_of(rel)
    for path in paths_in(code_of(open(os.path.join(ROOT, rel)).read())):
        r = resolve(m, path, modules)
        if r is None or r == m:
            continue
        # An ancestor naming its descendant, or the reverse, is one unit.
        if r[: len(m)] == m or m[: len(r)] == r:
            continue
        edges.add((m, r))


def sccs_of(nodes, edges):
    graph = {m: set() for m in nodes}
    for a, b in edges:
        graph[a].add(b)
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(comp)

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return [sorted(c) for c in out if len(c) > 1]


name = lambda m: "::".join(m) or "crate"
if "--graph" in sys.argv:
    for a, b in sorted(edges):
        print(f"{name(a)} -> {name(b)}")
failed = False
parents = {m[:-1] for m in modules if m}
for parent in sorted(parents):
    depth = len(parent) + 1
    nodes = {m[:depth] for m in modules if len(m) >= depth and m[: len(parent)] == parent}
    level = set()
    for a, b in edges:
        if a[: len(parent)] == parent and b[: len(parent)] == parent and len(a) >= depth and len(b) >= depth:
            if a[:depth] != b[:depth]:
                level.add((a[:depth], b[:depth]))
    for c in sccs_of(nodes, level):
        failed = True
        inner = sorted((a, b) for a, b in level if a in c and b in c)
        print(f"cycle among the children of {name(parent)}: "
              + ", ".join(name(x) for x in c) + ": "
              + "; ".join(f"{name(a)} -> {name(b)}" for a, b in inner))
print(f"modules.py: {len(modules)} modules, {len(edges)} edges, "
      + ("cycles above" if failed else "no cycle at any level"), file=sys.stderr)
sys.exit(1 if failed else 0)
