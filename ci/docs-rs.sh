#!/usr/bin/env bash
# Builds the documentation of each publishable workspace member that has a `[package.metadata.docs.rs]` (with
# `--all`: of every publishable member) as docs.rs builds it: alone (`-p`, `--no-deps`), on nightly, with the
# features and rustdoc arguments of that table (default features where it has none), into target/docsrs. Then checks that each feature named in a `doc(cfg(feature = "..."))`
# mark of a crate's sources shows on its rendered pages ("Available on crate feature `X` only").
# Installs nightly (minimal profile) with rustup when it is missing; never updates an installed one.
# Each member alone resolves its own feature set, so each costs a check of part of its dependencies again (the
# facade with cuda and rocm: about 250 s of CPU from cold); `--all` is for a release, CI runs the default.
# Usage: ci/docs-rs.sh [--all] (from anywhere in the repository).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! cargo +nightly --version >/dev/null 2>&1; then
    rustup toolchain install nightly --profile minimal >&2
fi
cargo +nightly --version
export CARGO_TARGET_DIR="${ANYCCL_DOCSRS_TARGET_DIR:-target/docsrs}"

# One line per publishable member: name, library target name, manifest directory, cargo flags, rustdoc args.
all="${1:-}"
plan="$(cargo metadata --locked --no-deps --format-version 1 | ANYCCL_DOCSRS_ALL="$all" python3 -c '
import json, os, sys
m = json.load(sys.stdin)
ws = set(m["workspace_members"])
for p in m["packages"]:
    if p["id"] not in ws or p.get("publish") == []:
        continue
    libs = [t["name"] for t in p["targets"] if any(k in ("lib", "rlib", "cdylib", "staticlib", "dylib") for k in t["kind"])]
    if not libs:
        continue
    d = ((p.get("metadata") or {}).get("docs") or {}).get("rs")
    if d is None and os.environ.get("ANYCCL_DOCSRS_ALL") != "--all":
        continue
    d = d or {}
    flags = []
    if d.get("all-features"):
        flags.append("--all-features")
    if d.get("no-default-features"):
        flags.append("--no-default-features")
    if d.get("features"):
        flags.append("--features=" + ",".join(d["features"]))
    args = " ".join(d.get("rustdoc-args", []))
    print("\t".join([p["name"], libs[0].replace("-", "_"), p["manifest_path"].rsplit("/", 1)[0], " ".join(flags), args]))
')"

fail=0
while IFS=$'\t' read -r name lib dir flags args; do
    echo "== $name ${flags:-(default features)} ${args:+rustdoc $args}"
    # shellcheck disable=SC2086 # flags and args are word lists
    RUSTDOCFLAGS="$args" cargo +nightly doc --locked --no-deps -p "$name" $flags
    html="$CARGO_TARGET_DIR/doc/$lib"
    [ -f "$html/index.html" ] || { echo "error: $name: no $html/index.html"; fail=1; continue; }
    if [[ " $args " == *" docsrs "* ]]; then
        for f in $(grep -rhoE 'doc\(cfg\(feature = "[^"]+"' "$dir/src" | sed 's/.*"\(.*\)"/\1/' | sort -u); do
            # rustdoc writes "Available on crate feature `X` only" (or "features `X` or `Y`") on the marked items.
            if ! grep -rqE "Available on crate features? [^\"<]*\`$f\`" "$html"; then
                echo "error: $name: no page says which items need the feature $f"; fail=1
            fi
        done
    fi
done <<<"$plan"
exit "$fail"
