#!/usr/bin/env bash
# Checks what `cargo package` would publish, for every workspace member that can be published (`publish` not
# false in its Cargo.toml; found through `cargo metadata`, so a new crate is covered without editing this list):
#   - no CI scripts (ci/, .ci/), helper scripts (scripts/), lab or test-support code (lab/, testkit/, tests/support/)
#     and no fake vendor libraries (fake*), whatever directory they sit in;
#   - both licence files (LICENSE-APACHE, LICENSE-MIT) at the package root;
#   - no placeholder URL in the manifest's repository, homepage or documentation.
# Lists only; builds nothing. Usage: ci/check-packages.sh (from anywhere in the repository).
set -euo pipefail
cd "$(dirname "$0")/.."

members="$(cargo metadata --locked --no-deps --format-version 1 | python3 -c '
import json, sys
m = json.load(sys.stdin)
ws = set(m["workspace_members"])
for p in m["packages"]:
    if p["id"] in ws and p.get("publish") != []:
        urls = [p.get(k) or "" for k in ("repository", "homepage", "documentation")]
        print(p["name"], " ".join(u for u in urls if u) or "-")
')"
[ -n "$members" ] || { echo "error: cargo metadata lists no publishable member"; exit 1; }

fail=0
while read -r name urls; do
    list="$(cargo package --quiet --locked --list --allow-dirty -p "$name")"
    bad="$(grep -E '(^|/)(ci|\.ci|scripts|lab|testkit)/|(^|/)tests/support/|(^|/)fake[^/]*$' <<<"$list" || true)"
    if [ -n "$bad" ]; then
        echo "error: $name would publish files that are not its own sources:"; sed 's/^/    /' <<<"$bad"; fail=1
    fi
    for lic in LICENSE-APACHE LICENSE-MIT; do
        grep -qx "$lic" <<<"$list" || { echo "error: $name would publish no $lic"; fail=1; }
    done
    if grep -qiE 'example\.(invalid|com|org)|localhost' <<<"$urls"; then
        echo "error: $name has a placeholder URL: $urls"; fail=1
    fi
    echo "$name: $(wc -l <<<"$list") files"
done <<<"$members"
exit "$fail"
