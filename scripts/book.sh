#!/usr/bin/env bash
# Builds the book (docs/, mdBook) into target/book/ and checks every link of
# it and of the Markdown it is made from (scripts/links.py). CI runs it.
#
#   scripts/book.sh          # build and check; open target/book/index.html
#
# mdbook is installed from crates.io at the pinned version when the one on
# PATH is another (without its `serve` and `watch` features: nothing here
# needs a server, and they double its build).
set -euo pipefail
cd "$(dirname "$0")/.."
mdbook_version=0.5.4
if [ -f "$HOME/.cargo/env" ]; then
  # shellcheck disable=SC1091
  . "$HOME/.cargo/env"
fi
if [ "$(mdbook --version 2>/dev/null)" != "mdbook v$mdbook_version" ]; then
  echo "book.sh: installing mdbook $mdbook_version" >&2
  cargo install mdbook --version "$mdbook_version" --locked --quiet \
    --no-default-features --features search
fi
mdbook build docs
python3 scripts/links.py target/book
