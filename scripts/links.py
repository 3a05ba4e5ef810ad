#!/usr/bin/env python3
"""Checks every relative link of the documentation, both ways it is read.

    scripts/links.py target/book    # the built book (scripts/book.sh)

- The Markdown, as GitHub shows it: README.md, ARCHITECTURE.md,
  RELIABILITY.md, BENCHMARKS.md, every entry of the perf log
  (docs/perf-log) and every page under docs/src. A link to a
  file must name one that exists; a `#fragment` must be a heading of the
  page it points into (GitHub's and mdBook's slugs agree for our headings).
- The HTML mdBook built (when a directory is given): every `href` and `src`
  inside the book names a file of the book, and every fragment an `id` in it
  (the pages `{{#include}}` pulls in from the repository are checked there).
- Every page under docs/src is reachable from docs/src/SUMMARY.md (mdBook
  leaves an unlisted page out of the book without a word).
- A repository path in a code span (`src/…`, `tests/…`, `scripts/…` and
  the other top-level folders) names one that exists, outside the perf
  log (whose entries are records of their day).
Links off the machine (http, https, mailto) are not followed: CI has no
network. Exit 1 with one line per broken link.
"""
import html.parser
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# [text](target) or ![alt](target), the text across lines, an optional "title".
LINK = re.compile(r'(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+"[^"]*")?\)|!\[[^\]]*\]\(([^)\s]+)(?:\s+"[^"]*")?\)')


def slug(title):
    title = re.sub(r"`|\*\*|\*", "", title).strip().lower()
    title = re.sub(r"[^\w\- ]", "", title)
    return title.replace(" ", "-")


def outside_fences(text):
    fence = False
    for n, line in enumerate(text.split("\n"), 1):
        if line.startswith("```"):
            fence = not fence
            continue
        if not fence:
            yield n, line


def anchors_of_markdown(path):
    """Heading slugs, a repeated one numbered as GitHub and mdBook do."""
    seen, out = {}, set()
    for _, l in outside_fences(open(path).read()):
        if re.match(r"#+ ", l):
            base = slug(l.lstrip("#"))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def prose(text):
    """`text` with fenced blocks and code spans blanked (lines kept, so a
    position still gives its line number)."""
    lines, fence = [], None
    for line in text.split("\n"):
        marker = re.match(r"\s*(```|~~~)", line)
        if marker and (fence is None or marker.group(1) == fence):
            fence = None if fence else marker.group(1)
            lines.append("")
        else:
            lines.append("" if fence else line)
    return re.sub(r"`[^`\n]*`", "", "\n".join(lines))


def markdown_files():
    yield from (os.path.join(ROOT, f) for f in ("README.md", "ARCHITECTURE.md", "RELIABILITY.md", "BENCHMARKS.md"))
    log = os.path.join(ROOT, "docs", "perf-log")
    yield from (os.path.join(log, f) for f in sorted(os.listdir(log)) if f.endswith(".md"))
    for d, _, files in os.walk(os.path.join(ROOT, "docs", "src")):
        yield from (os.path.join(d, f) for f in sorted(files) if f.endswith(".md"))


def check_markdown(broken):
    for path in markdown_files():
        text = prose(open(path).read())
        for m in LINK.finditer(text):
            target = m.group(1) or m.group(2)
            n = text.count("\n", 0, m.start()) + 1
            if re.match(r"[a-z]+:", target):
                continue
            file, _, fragment = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            where = f"{os.path.relpath(path, ROOT)}:{n}: {target}"
            if not os.path.exists(dest):
                broken.append(f"{where}: no such file")
            elif fragment and dest.endswith(".md") and fragment not in anchors_of_markdown(dest):
                broken.append(f"{where}: no heading #{fragment}")


# A repository path in a code span, up to the first character no path of
# ours has (a glob's `*`, a `:line`, a space).
PATH = re.compile(r"`((?:src|tests|scripts|bench|benches|docs|config|fuzz|examples|deploy|\.ci)/[A-Za-z0-9_./-]*)")


def check_paths(broken):
    for path in markdown_files():
        if os.sep + "perf-log" + os.sep in path:
            continue
        for n, line in outside_fences(open(path).read()):
            for m in PATH.finditer(line):
                p = m.group(1).rstrip(".")
                if not os.path.exists(os.path.join(ROOT, p)):
                    broken.append(f"{os.path.relpath(path, ROOT)}:{n}: `{p}`: no such file")


def check_summary(broken):
    src = os.path.join(ROOT, "docs", "src")
    listed = {os.path.normpath(os.path.join(src, m.group(1))) for m in LINK.finditer(open(os.path.join(src, "SUMMARY.md")).read()) if m.group(1)}
    for d, _, files in os.walk(src):
        for f in files:
            p = os.path.normpath(os.path.join(d, f))
            if f.endswith(".md") and f != "SUMMARY.md" and p not in listed:
                broken.append(f"docs/src/{os.path.relpath(p, src)}: not in SUMMARY.md, so not in the book")


class Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids, self.refs = set(), []

    def handle_starttag(self, tag, attrs):
        for k, v in attrs:
            if k in ("id", "name") and v:
                self.ids.add(v)
            if k in ("href", "src") and v:
                self.refs.append(v)


def check_html(book, broken):
    pages = {}
    for d, _, files in os.walk(book):
        for f in files:
            if f.endswith(".html"):
                p = Page()
                p.feed(open(os.path.join(d, f), errors="replace").read())
                pages[os.path.normpath(os.path.join(d, f))] = p
    if not pages:
        broken.append(f"{book}: no HTML: was the book built?")
    for path, page in pages.items():
        for ref in page.refs:
            if re.match(r"[a-z]+:|//", ref):
                continue
            file, _, fragment = ref.partition("#")
            file = file.split("?")[0]
            if file.startswith("/"):
                # mdBook's site root (404.html links there): the book's own.
                dest = os.path.normpath(os.path.join(book, file.lstrip("/")))
            else:
                dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            if os.path.isdir(dest):
                dest = os.path.join(dest, "index.html")
            where = f"{os.path.relpath(path, book)}: {ref}"
            if not os.path.exists(dest):
                broken.append(f"{where}: no such file in the book")
            elif fragment and dest in pages and fragment not in pages[dest].ids:
                broken.append(f"{where}: no element #{fragment}")


def main():
    broken = []
    check_markdown(broken)
    check_paths(broken)
    check_summary(broken)
    if len(sys.argv) > 1:
        check_html(sys.argv[1], broken)
    for b in broken:
        print(f"links: {b}", file=sys.stderr)
    if broken:
        print(f"links: {len(broken)} broken", file=sys.stderr)
        return 1
    print("links: every relative link and named path of the Markdown" + (" and the built book" if len(sys.argv) > 1 else "") + " resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
