#!/usr/bin/env bash
# Checks what `cargo package` would publish, for every workspace member that can be published (`publish` not
# false in its Cargo.toml; found through `cargo metadata`, so a new crate is covered without editing this list):
#   - no CI scripts (ci/, .ci/), helper scripts (scripts/), lab or test-support code (lab/, testkit/, tests/support/)
#     and no fake vendor libraries (fake*), whatever directory they sit in;
#   - both licence files (LICENSE-APACHE, LICENSE-MIT) at the package root;
#   - no placeholder URL in the manifest's repository, homepage or documentation;
#   - the crate's build script (a `build.rs`, or the `build` its manifest names) when it has one: an `include` that
#     leaves it out publishes a crate that builds without it (the drop-in would lose its SONAME).
# Lists only; builds nothing. Usage: ci/check-packages.sh (from anywhere in the repository).
set -euo pipefail
cd "$(dirname "$0")/.."

members="$(cargo metadata --locked --no-deps --format-version 1 | python3 -c '
import json, os, sys
m = json.load(sys.stdin)
ws = set(m["workspace_members"])
for p in m["packages"]:
    if p["id"] in ws and p.get("publish") != []:
        urls = [p.get(k) or "" for k in ("repository", "homepage", "documentation")]
        root = os.path.dirname(p["manifest_path"])
        # The build script cargo runs (a custom-build target), else a build.rs lying in the crate directory (which
        # cargo would run unless the manifest says build = false): relative to the crate directory.
        builds = [os.path.relpath(t["src_path"], root) for t in p["targets"] if "custom-build" in t["kind"]]
        if not builds and os.path.isfile(os.path.join(root, "build.rs")) and p.get("build") is not False:
            builds = ["build.rs"]
        print(p["name"], ",".join(builds) or "-", " ".join(u for u in urls if u) or "-")
')"
[ -n "$members" ] || { echo "error: cargo metadata lists no publishable member"; exit 1; }

fail=0
while read -r name builds urls; do
    list="$(cargo package --quiet --locked --list --allow-dirty -p "$name")"
    bad="$(grep -E '(^|/)(ci|\.ci|scripts|lab|testkit)/|(^|/)tests/support/|(^|/)fake[^/]*$' <<<"$list" || true)"
    if [ -n "$bad" ]; then
        echo "error: $name would publish files that are not its own sources:"; sed 's/^/    /' <<<"$bad"; fail=1
    fi
    for lic in LICENSE-APACHE LICENSE-MIT; do
        grep -qx "$lic" <<<"$list" || { echo "error: $name would publish no $lic"; fail=1; }
    done
    if [ "$builds" != - ]; then
        for b in ${builds//,/ }; do
            grep -qxF "$b" <<<"$list" || { echo "error: $name has a build script, $b, that its package leaves out"; fail=1; }
        done
    fi
    if grep -qiE 'example\.(invalid|com|org)|localhost' <<<"$urls"; then
        echo "error: $name has a placeholder URL: $urls"; fail=1
    fi
    echo "$name: $(wc -l <<<"$list") files"
done <<<"$members"
exit "$fail"
