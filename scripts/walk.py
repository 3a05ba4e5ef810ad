#!/usr/bin/env python3
"""Walks the book's Getting started page as a newcomer would: every shell
block marked `<!-- walk -->` in docs/src/getting-started.md runs, in order,
in one bash (so a variable or a background job of one block is there in the
next), and every line ending in `# → TEXT` must print TEXT. The page is the
script: a step that stops working fails CI, and a step CI runs is one a
reader can copy.

What the walk changes, so that runs share nothing with each other or with
the machine (the reader's values stay on the page):
  - the database: `BLOOMGATE_DB`, a name of its own, dropped at the end on
    both servers it was made on, with the bus's replication slot;
  - the bus's slot: `BLOOMGATE_BUS__SLOT`, a name of its own;
  - /tmp/private.toml: a file in a scratch directory;
  - target/release/bloomgate: BLOOMGATE_BIN (default target/debug/bloomgate,
    built by `cargo build` first), so CI does not build a release binary.

And what it holds the page to:
  - no fixed port: the page picks free ones (a fixed port may be taken on
    a shared machine), and the ports it once fixed (8080, 8081, 8082, 6390)
    are held by the walk while it runs, where they are free;
  - a second run: the database exists already on the `wal_level =
    logical` server (`scripts/pg.sh logical`) when the page comes to it,
    as it does when a reader runs the page again.

    scripts/walk.py            # exit 1 and the failing line on a failure
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "src", "getting-started.md")
CHECK = re.compile(r"^(?P<cmd>.*?)\s+# → (?P<want>.+)$")


def blocks(text):
    """The `sh` blocks that follow a `<!-- walk -->` line."""
    out, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        if lines[i].strip() == "<!-- walk -->":
            assert lines[i + 1].startswith("```sh"), f"line {i + 2}: a walk block is ```sh"
            j = i + 2
            while not lines[j].startswith("```"):
                j += 1
            out.append((i + 3, lines[i + 2 : j]))
            i = j
        i += 1
    return out


def hold(port):
    """A socket listening on `port` of every address (so that nothing else
    may bind it), or None when it is taken already."""
    s = socket.socket()
    try:
        s.bind(("0.0.0.0", port))
        s.listen()
        return s
    except OSError:
        s.close()
        return None


def quote(s):
    return "'" + s.replace("'", "'\\''") + "'"


def script(page_blocks, scratch):
    """One bash script of the blocks: each checked line asserts its text."""
    out = ["set -euo pipefail"]
    for first, lines in page_blocks:
        for n, line in enumerate(lines, first):
            line = line.replace("target/release/bloomgate", '"$BLOOMGATE_BIN"')
            line = line.replace("/tmp/private.toml", f"{scratch}/private.toml")
            m = CHECK.match(line)
            if not m:
                out.append(line)
                continue
            cmd, want = m.group("cmd"), m.group("want")
            where = f"getting-started.md:{n}"
            # `curl … | head -1`: head closing the pipe early is not a failure.
            out.append(f"out=$(set +o pipefail; {cmd}) || {{ echo {quote('walk: ' + where + ' failed')} >&2; exit 1; }}")
            out.append('printf "%s\\n" "$out"')
            out.append(
                f'case "$out" in *{quote(want)}*) ;; *) '
                f"echo {quote('walk: ' + where + ': expected ' + want)} >&2; exit 1 ;; esac"
            )
    return "\n".join(out) + "\n"


def psql(url, sql):
    subprocess.run(["psql", "-Xq", url, "-c", sql], check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main():
    os.chdir(ROOT)
    binary = os.environ.get("BLOOMGATE_BIN")
    if not binary:
        subprocess.run(["cargo", "build", "--locked", "--bin", "bloomgate"], check=True)
        binary = "target/debug/bloomgate"
    held = [h for h in map(hold, (8080, 8081, 8082, 6390)) if h]
    db = f"walk_{os.getpid()}"
    slot = f"walk_{os.getpid()}_bus"
    logical = subprocess.run(["bash", "scripts/pg.sh", "logical"], check=True,
                             capture_output=True, text=True).stdout.strip()
    psql(f"{logical}/postgres", f'CREATE DATABASE "{db}"')
    scratch = tempfile.mkdtemp(prefix="bloomgate-walk-")
    text = script(blocks(open(PAGE).read()), scratch)
    open(os.path.join(scratch, "walk.sh"), "w").write(text)
    env = dict(os.environ)
    env.update(
        BLOOMGATE_BIN=os.path.abspath(binary),
        BLOOMGATE_DB=db,
        BLOOMGATE_BUS__SLOT=slot,
        USERS="2000",
        ARTICLES="100",
        RUST_LOG="warn",
    )
    # A session of its own: the cleanup reaches every process the page started.
    walk = subprocess.Popen(["bash", os.path.join(scratch, "walk.sh")], env=env,
                            start_new_session=True)
    try:
        status = walk.wait(timeout=600)
    except subprocess.TimeoutExpired:
        print("walk: still running after 600 s", file=sys.stderr)
        status = 1
    finally:
        # SIGINT: the gateways stop without SIGTERM's drain; whatever is
        # left of the page's processes after 20 s is killed. The slots are
        # dropped below only once nothing holds them.
        for sig, grace in ((signal.SIGINT, 20), (signal.SIGKILL, 5)):
            try:
                os.killpg(walk.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                try:
                    os.killpg(walk.pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
        for h in held:
            h.close()
        servers = subprocess.run(["bash", "-c", ". scripts/pg.sh; ensure_postgres >/dev/null 2>&1; echo \"$PG_BASE_URL\""],
                                 capture_output=True, text=True).stdout.split() + [logical]

        for url in servers:
            # The gateways take up to their shutdown to let their slots go.
            for _ in range(200):
                held = subprocess.run(["psql", "-XAtq", f"{url}/postgres", "-c",
                                       f"SELECT count(*) FROM pg_replication_slots WHERE database = '{db}' AND active"],
                                      capture_output=True, text=True).stdout.strip()
                if held in ("", "0"):
                    break
                time.sleep(0.1)
            psql(f"{url}/postgres", f"SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = '{db}'")
            psql(f"{url}/postgres", f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        shutil.rmtree(scratch, ignore_errors=True)
    if status != 0:
        print(f"walk: failed (exit {status})", file=sys.stderr)
        return 1
    print("walk: every step of docs/src/getting-started.md did what the page says")
    return 0


if __name__ == "__main__":
    sys.exit(main())
