#!/usr/bin/env python3
"""Builds the anyccl source distribution: ``maturin sdist``, then the files of the workspace's root crate that
maturin leaves out.

The extension crate (python/) depends on the ``anyccl`` crate, which is also the workspace root. ``maturin sdist``
(1.16.0) copies the root's Cargo.toml, Cargo.lock and README.md but not that crate's sources,
so the sdist could not build. This adds them: the files ``cargo package --list -p anyccl`` names under src/, tests/,
examples/, benches/ and build.rs, the files of the test, example and bench targets the root manifest declares (cargo
checks they exist when it loads the manifest; the package's include list leaves tests out), and
the two licence files, to the tarball maturin wrote; and points the sdist's pyproject.toml (which maturin puts at the
top, next to the workspace's README.md) at python/README.md. It also leaves out the test support crate (testkit/),
which maturin copies because the workspace's crates name it as a dev-dependency: the wheel's build never compiles a
dev-dependency, so the sdist's manifests drop those entries and the workspace member (a testkit entry anywhere else
stops the script). Needs a maturin that writes this workspace's sdist at all (1.16.0 does; 1.9.6 stops at the two
README.md files).

    python python/tools/sdist.py OUT_DIR [MATURIN]    # Python 3.11+, from anywhere; prints the sdist's path
"""

from __future__ import annotations

import gzip
import io
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KEEP = ("src/", "tests/", "examples/", "benches/")
KEEP_FILES = ("build.rs", "LICENSE-APACHE", "LICENSE-MIT")


def root_crate_files() -> list[str]:
    listed = subprocess.run(
        ["cargo", "package", "--list", "--allow-dirty", "-p", "anyccl"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    files = {p for p in listed if p.startswith(KEEP) or p in KEEP_FILES}
    # The package's include list leaves tests out, but cargo checks that every target the manifest declares exists
    # when it loads it: the declared targets' files come along too.
    return sorted(files | declared_target_files())


def declared_target_files() -> set[str]:
    import tomllib

    manifest = tomllib.loads((ROOT / "Cargo.toml").read_text(encoding="utf-8"))
    found = set()
    for kind, folder in (("test", "tests"), ("example", "examples"), ("bench", "benches")):
        for target in manifest.get(kind, []):
            rel = target.get("path", f"{folder}/{target['name']}.rs")
            if not (ROOT / rel).is_file():
                raise SystemExit(f"Cargo.toml declares the {kind} {target['name']!r} at {rel}, which does not exist")
            found.add(rel)
    return found


TESTKIT = "anyccl-testkit"


def without_testkit(name: str, text: str) -> str:
    """A manifest of the sdist without the test support crate: its dev-dependency entries, its workspace dependency
    and its workspace member go; an entry in any other table means the build needs it, and stops the script."""
    out = []
    section = ""
    for line in text.splitlines(keepends=True):
        head = re.match(r"\s*\[([^\]]+)\]\s*$", line)
        if head:
            section = head.group(1).strip()
        elif re.match(rf"\s*{TESTKIT}\s*=", line):
            if section not in ("dev-dependencies", "workspace.dependencies"):
                raise SystemExit(f"{name}: {TESTKIT} is in [{section}], so the build needs it")
            continue
        out.append(line)
    fixed = "".join(out)

    def drop_member(m: "re.Match[str]") -> str:
        members = [x for x in re.findall(r'"([^"]*)"', m.group(1)) if x != "testkit"]
        return "members = [" + ", ".join(f'"{x}"' for x in members) + "]"

    fixed = re.sub(r"members\s*=\s*\[(.*?)\]", drop_member, fixed, count=1, flags=re.S)
    left = [line for line in fixed.splitlines() if TESTKIT in line.split("#")[0] or '"testkit"' in line.split("#")[0]]
    if left:
        raise SystemExit(f"{name}: the test support crate is still named: {left}")
    return fixed


def main() -> int:
    if len(sys.argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(sys.argv[1]).resolve()
    maturin = sys.argv[2] if len(sys.argv) == 3 else "maturin"
    out.mkdir(parents=True, exist_ok=True)
    before = set(out.glob("*.tar.gz"))
    subprocess.run([maturin, "sdist", "-m", str(ROOT / "python" / "Cargo.toml"), "-o", str(out)], check=True)
    made = sorted(set(out.glob("*.tar.gz")) - before) or sorted(out.glob("anyccl-*.tar.gz"))
    if len(made) != 1:
        print(f"expected one sdist in {out}, found {made}", file=sys.stderr)
        return 1
    sdist = made[0]
    with tarfile.open(sdist, "r:gz") as tar:
        members = [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]  # type: ignore[union-attr]
    top = members[0][0].name.split("/")[0]
    have = {m.name for m, _ in members}
    added = 0
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for m, data in members:
            if m.name.startswith(f"{top}/testkit/") or m.name == f"{top}/testkit":
                continue
            if m.name.endswith("/Cargo.toml") and data is not None:
                data = without_testkit(m.name, data.decode("utf-8")).encode("utf-8")
                m.size = len(data)
            if m.name == f"{top}/pyproject.toml" and data is not None:
                # maturin moves pyproject.toml to the sdist's top, where README.md is the workspace's: the package's
                # own readme is python/README.md there.
                text = data.decode("utf-8")
                fixed = text.replace('readme = "README.md"', 'readme = "python/README.md"', 1)
                if fixed == text:
                    raise SystemExit(f"{m.name}: no readme line to point at python/README.md")
                data = fixed.encode("utf-8")
                m.size = len(data)
            tar.addfile(m, io.BytesIO(data) if data is not None else None)
        for rel in root_crate_files():
            name = f"{top}/{rel}"
            if name in have:
                continue
            src = ROOT / rel
            info = tar.gettarinfo(str(src), arcname=name)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with open(src, "rb") as f:
                tar.addfile(info, f)
            added += 1
    tmp = sdist.with_suffix(".tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, sdist)
    print(f"added {added} files of the root crate to {sdist}", file=sys.stderr)
    print(sdist)
    return 0


if __name__ == "__main__":
    sys.exit(main())
