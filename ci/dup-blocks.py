#!/usr/bin/env python3
"""Repeated blocks of N+ lines (default 6) between two trees (default backends/cuda and backends/rocm).

Each line is normalised (whitespace collapsed, `//` comment lines and blank lines dropped); every window of N
consecutive normalised lines is hashed, and a window present in both trees starts a repeated block. Consecutive
repeated windows in one file count as one block. Prints each block (file:line of both sides) and the count.
Usage: ci/dup-blocks.py [N] [TREE_A TREE_B]
"""
import hashlib
import os
import re
import sys


def lines_of(path):
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for no, raw in enumerate(f, 1):
            s = re.sub(r"\s+", " ", raw.strip())
            if not s or s.startswith("//"):
                continue
            out.append((no, s))
    return out


def windows(tree, n):
    found = {}
    for root, _, files in os.walk(tree):
        for name in sorted(files):
            if not name.endswith((".rs", ".c", ".h", ".cu", ".hip")):
                continue
            path = os.path.join(root, name)
            ls = lines_of(path)
            for i in range(len(ls) - n + 1):
                chunk = [s for _, s in ls[i : i + n]]
                # Windows of braces and closers alone say nothing.
                if sum(len(s) > 3 for s in chunk) < n // 2:
                    continue
                h = hashlib.sha1("\n".join(chunk).encode()).hexdigest()
                found.setdefault(h, []).append((path, ls[i][0], i))
    return found


def main():
    args = sys.argv[1:]
    n = int(args.pop(0)) if args and args[0].isdigit() else 6
    a, b = (args + ["backends/cuda", "backends/rocm"])[:2] if len(args) < 2 else args[:2]
    wa, wb = windows(a, n), windows(b, n)
    shared = set(wa) & set(wb)
    # Group consecutive windows of one file of tree A into blocks.
    starts = sorted((p, i, line, h) for h in shared for p, line, i in wa[h])
    blocks = []
    prev = None
    for p, i, line, h in starts:
        if prev and prev[0] == p and prev[1] + 1 == i:
            blocks[-1][2] = i
        else:
            other = wb[h][0]
            blocks.append([p, line, i, f"{other[0]}:{other[1]}"])
        prev = (p, i)
    for p, line, _, other in blocks:
        print(f"{p}:{line} ~ {other}")
    print(f"{len(blocks)} repeated blocks of {n}+ lines between {a} and {b}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
