#!/usr/bin/env python3
"""torch.distributed (backend nccl) through the anyccl drop-in libnccl, every collective checked exactly.

How PyTorch reaches NCCL decides whether LD_PRELOAD works: the PyPI CUDA wheels of torch link libtorch_cuda.so to
libnccl.so.2 dynamically (DT_NEEDED, found through its RUNPATH in site-packages/nvidia/nccl/lib, the
nvidia-nccl-cu12/cu13 wheel), so a preloaded library that exports the nccl* symbols comes first in the global scope
and interposes every call; the drop-in then finds torch's own libnccl.so.2 (already loaded, by its soname) and
forwards to it. A build with NCCL linked in statically has no libnccl.so.2 to interpose: its calls never reach a
preloaded library. This script does not trust either story: it reads the drop-in's counter of forwarded collective
and point-to-point calls (anyccl_nccl_dropin_calls, looked up in the global scope) around every operation and FAILS
when an operation made no call through the drop-in; it also prints which NCCL files are mapped into the process.

Each rank runs, for bf16 and f32 and two sizes, all_reduce (sum, max, avg), all_gather_into_tensor,
reduce_scatter_tensor, broadcast, reduce, all_to_all_single and (world > 1) send/recv in a ring: once eagerly, then
each captured in its own torch.cuda.graph and replayed 3 times with new inputs; every result is compared exactly with
the value computed on the host side (small integers, exact in bf16; avg at a world that is not a power of two is
compared within one bf16/f32 rounding). reduce checks the root only (NCCL leaves other ranks' buffers as they were
or undefined).

Usage (the drop-in is preloaded by re-executing this script with LD_PRELOAD when it is not yet):
  python3 scripts/dropin_torch.py --dropin target/release/libanyccl_nccl.so [--world N]
  python3 scripts/dropin_torch.py --baseline [--world N]          # the same checks on torch's NCCL directly
  LD_PRELOAD=$PWD/target/release/libanyccl_nccl.so torchrun --nproc-per-node N scripts/dropin_torch.py --dropin ...
With --world N (N > 1) and no torchrun environment, it starts N ranks itself (one GPU each). Exit status 0 only
when every check on every rank passed.
"""

import argparse
import ctypes
import os
import socket
import subprocess
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dropin", help="the drop-in library (libanyccl_nccl.so); default $ANYCCL_DROPIN_SO")
    p.add_argument("--baseline", action="store_true", help="run on torch's NCCL directly (no drop-in, no counter)")
    p.add_argument("--world", type=int, default=1, help="ranks to start when not under torchrun (default 1)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds the whole run may take (launcher)")
    return p.parse_args()


def preloaded(path):
    real = os.path.realpath(path)
    return any(os.path.realpath(e) == real for e in os.environ.get("LD_PRELOAD", "").replace(":", " ").split() if e)


def ensure_preloaded(args):
    """Re-executes this script with the drop-in in LD_PRELOAD (before torch is imported) when it is not there."""
    if args.baseline:
        return None
    path = args.dropin or os.environ.get("ANYCCL_DROPIN_SO")
    if not path:
        sys.exit("error: give --dropin PATH (or ANYCCL_DROPIN_SO), or --baseline")
    if not os.path.isfile(path):
        sys.exit(f"error: the drop-in {path} does not exist (cargo build --release -p anyccl-nccl)")
    path = os.path.realpath(path)
    if not preloaded(path):
        env = dict(os.environ)
        env["LD_PRELOAD"] = path + (" " + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
        os.execve(sys.executable, [sys.executable] + sys.argv, env)
    return path


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args):
    """Starts args.world ranks of this script (no torchrun environment) and waits for all of them."""
    port = str(free_port())
    procs = []
    for r in range(args.world):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(args.world),
                   LOCAL_WORLD_SIZE=str(args.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable] + sys.argv, env=env))
    deadline = time.monotonic() + args.timeout
    codes = []
    for r, p in enumerate(procs):
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            codes.append(f"killed after {args.timeout:.0f} s")
    ok = all(c == 0 for c in codes)
    print(f"SUMMARY world={args.world} ranks' exit statuses {codes}: {'PASS' if ok else 'FAIL'}", flush=True)
    return 0 if ok else 1


def nccl_files_mapped():
    files = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and "nccl" in os.path.basename(parts[5]).lower():
                files.add(parts[5])
    return sorted(files)


class DropIn:
    """The drop-in's counters, looked up in the process's global scope (where an interposing library must be)."""

    def __init__(self, path):
        self.path = path
        glob = ctypes.CDLL(None)
        try:
            self._calls = glob.anyccl_nccl_dropin_calls
            self._underlying = glob.anyccl_nccl_dropin_underlying
        except AttributeError:
            sys.exit(f"FAIL: anyccl_nccl_dropin_calls is not in the global scope: {path} was not preloaded "
                     f"(LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r})")
        self._calls.restype = ctypes.c_uint64
        self._calls.argtypes = []
        self._underlying.restype = ctypes.c_char_p
        self._underlying.argtypes = []

    def calls(self):
        return int(self._calls())

    def underlying(self):
        return (self._underlying() or b"").decode(errors="replace")


def main():
    args = parse_args()
    dropin_path = ensure_preloaded(args)
    if "WORLD_SIZE" not in os.environ:
        if args.world > 1:
            return launch(args)
        if args.world < 1:
            sys.exit("error: --world must be at least 1")
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    return run_rank(dropin_path)


def run_rank(dropin_path):
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    drop = DropIn(dropin_path) if dropin_path else None
    calls0 = drop.calls() if drop else 0
    try:
        dist.init_process_group("nccl", device_id=dev)
    except TypeError:  # torch before 2.3 has no device_id
        dist.init_process_group("nccl")
    mode = "dropin" if drop else "baseline"
    tag = f"[rank {rank}/{world} {mode}]"
    print(f"{tag} torch {torch.__version__} (CUDA {torch.version.cuda}), torch.cuda.nccl.version() = "
          f"{torch.cuda.nccl.version()}, GPU {torch.cuda.get_device_name(dev)}", flush=True)

    failures = []
    checks = 0
    notes = []

    def check(name, got, want, exact=True):
        nonlocal checks
        checks += 1
        got_f, want_f = got.float(), want.float()
        if got.shape != want.shape:
            failures.append(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
            return
        if exact:
            bad = (got_f != want_f)
        else:
            tol = 2.0 ** -7 if got.dtype == torch.bfloat16 else 1e-6
            bad = (got_f - want_f).abs() > tol * want_f.abs().clamp(min=1.0)
        nbad = int(bad.sum().item())
        if nbad:
            i = int(bad.nonzero()[0].item())
            failures.append(f"{name}: {nbad} of {got.numel()} wrong, first at {i}: got {got_f[i].item()} want "
                            f"{want_f[i].item()}")

    pow2 = world & (world - 1) == 0

    def cases(dtype, n):
        """(name, fill(k), run(), [(what, result(), expected(k))], exact) for one dtype and element count."""
        i = torch.arange(n, device=dev)
        w, r = world, rank
        c = lambda t: t.to(dtype)  # noqa: E731
        out = []

        t_sum = torch.empty(n, dtype=dtype, device=dev)
        out.append(("all_reduce(sum)", lambda k: t_sum.copy_(c((r + 1) + i % 7 + k)),
                    lambda: dist.all_reduce(t_sum, op=dist.ReduceOp.SUM),
                    [("", lambda: t_sum, lambda k: c(w * (w + 1) // 2 + w * (i % 7) + w * k))], True))
        t_max = torch.empty(n, dtype=dtype, device=dev)
        out.append(("all_reduce(max)", lambda k: t_max.copy_(c(r * 10 + i % 5 + k)),
                    lambda: dist.all_reduce(t_max, op=dist.ReduceOp.MAX),
                    [("", lambda: t_max, lambda k: c((w - 1) * 10 + i % 5 + k))], True))
        t_avg = torch.empty(n, dtype=dtype, device=dev)
        out.append(("all_reduce(avg)", lambda k: t_avg.copy_(c(2 * r + i % 4 + k)),
                    lambda: dist.all_reduce(t_avg, op=dist.ReduceOp.AVG),
                    [("", lambda: t_avg, lambda k: c((w - 1) + i % 4 + k))], pow2))
        ag_in = torch.empty(n, dtype=dtype, device=dev)
        ag_out = torch.empty(w * n, dtype=dtype, device=dev)
        out.append(("all_gather_into_tensor", lambda k: (ag_in.copy_(c(r * 8 + i % 8 + k)), ag_out.fill_(-1)),
                    lambda: dist.all_gather_into_tensor(ag_out, ag_in),
                    [("", lambda: ag_out,
                      lambda k: torch.cat([c(s * 8 + i % 8 + k) for s in range(w)]))], True))
        j = torch.arange(w * n, device=dev)
        rs_in = torch.empty(w * n, dtype=dtype, device=dev)
        rs_out = torch.empty(n, dtype=dtype, device=dev)
        out.append(("reduce_scatter_tensor(sum)", lambda k: (rs_in.copy_(c((r + 1) + j % 5 + k)), rs_out.fill_(-1)),
                    lambda: dist.reduce_scatter_tensor(rs_out, rs_in, op=dist.ReduceOp.SUM),
                    [("", lambda: rs_out,
                      lambda k: c(w * (w + 1) // 2 + w * ((r * n + i) % 5) + w * k))], True))
        root = w - 1
        bc = torch.empty(n, dtype=dtype, device=dev)
        out.append((f"broadcast(root {root})",
                    lambda k: bc.copy_(c(r * 3 + i % 6 + k)) if r == root else bc.fill_(-1),
                    lambda: dist.broadcast(bc, src=root),
                    [("", lambda: bc, lambda k: c(root * 3 + i % 6 + k))], True))
        rd = torch.empty(n, dtype=dtype, device=dev)
        out.append((f"reduce(sum, root {root})", lambda k: rd.copy_(c((r + 1) + i % 3 + k)),
                    lambda: dist.reduce(rd, dst=root, op=dist.ReduceOp.SUM),
                    [("", lambda: rd, lambda k: c(w * (w + 1) // 2 + w * (i % 3) + w * k))] if r == root else [],
                    True))
        a_in = torch.empty(w * n, dtype=dtype, device=dev)
        a_out = torch.empty(w * n, dtype=dtype, device=dev)
        out.append(("all_to_all_single", lambda k: (a_in.copy_(c(r * 16 + j // n + k)), a_out.fill_(-1)),
                    lambda: dist.all_to_all_single(a_out, a_in),
                    [("", lambda: a_out, lambda k: c((j // n) * 16 + r + k))], True))
        if w > 1:
            s_buf = torch.empty(n, dtype=dtype, device=dev)
            r_buf = torch.empty(n, dtype=dtype, device=dev)
            nxt, prv = (r + 1) % w, (r - 1) % w

            def sendrecv():
                ops = [dist.P2POp(dist.isend, s_buf, nxt), dist.P2POp(dist.irecv, r_buf, prv)]
                for req in dist.batch_isend_irecv(ops):
                    req.wait()

            out.append(("send/recv ring", lambda k: (s_buf.copy_(c(r * 4 + i % 4 + k)), r_buf.fill_(-1)),
                        sendrecv, [("", lambda: r_buf, lambda k: c(prv * 4 + i % 4 + k))], True))
        return out

    def through(name, before):
        if drop is None:
            return
        d = drop.calls() - before
        if d < 1 and world == 1:
            # At world 1 torch answers some collectives itself (reduce_scatter_tensor on the H200 run) without any
            # NCCL call; nothing can go through a drop-in then. Reported, not failed; every other op must call.
            no_call_world1.add(name.split(" ")[0])
        elif d < 1:
            failures.append(f"{name}: no NCCL call went through the drop-in (anyccl_nccl_dropin_calls unchanged): "
                            f"torch bypassed it")

    def graph_context(g):
        try:
            return torch.cuda.graph(g, capture_error_mode="thread_local")
        except TypeError:  # torch before 2.1
            return torch.cuda.graph(g)

    total_graph_replay_calls = 0
    no_call_world1 = set()
    for dtype in (torch.bfloat16, torch.float32):
        for n in (1031, 524291):
            for name, fill, run, results, exact in cases(dtype, n):
                label = f"{name} {str(dtype).replace('torch.', '')} n={n}"
                # Eager.
                fill(0)
                before = drop.calls() if drop else 0
                run()
                torch.cuda.synchronize()
                through(f"{label} eager", before)
                for what, res, want in results:
                    check(f"{label} eager{what}", res(), want(0), exact)
                # Captured once, replayed 3 times with new inputs.
                # thread_local: the capture forbids unsafe CUDA calls on this thread only, not on torch's NCCL
                # watchdog thread (which polls its events).
                g = torch.cuda.CUDAGraph()
                before = drop.calls() if drop else 0
                try:
                    with graph_context(g):
                        run()
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 - reported as a failure of this case, the others still run
                    failures.append(f"{label} graph capture raised {type(e).__name__}: {e}")
                    continue
                through(f"{label} capture", before)
                after_capture = drop.calls() if drop else 0
                for k in (1, 2, 3):
                    fill(k)
                    g.replay()
                    torch.cuda.synchronize()
                    for what, res, want in results:
                        check(f"{label} graph replay {k}{what}", res(), want(k), exact)
                if drop:
                    total_graph_replay_calls += drop.calls() - after_capture
                del g
    dist.barrier()
    mapped = nccl_files_mapped()
    if drop:
        calls = drop.calls() - calls0
        underlying = drop.underlying()
        others = [m for m in mapped if os.path.realpath(m) != os.path.realpath(drop.path)]
        notes.append(f"drop-in calls forwarded: {calls} (graph replays added {total_graph_replay_calls}: replay does "
                     f"not call the host API); forwards to: {underlying or '(nothing: see ncclGetLastError)'}")
        if not others:
            notes.append("no libnccl besides the drop-in is mapped: torch has NCCL linked in statically")
        if no_call_world1:
            notes.append(f"torch made no NCCL call at world 1 for: {sorted(no_call_world1)} (answered by torch itself)")
        if calls == 0:
            failures.append("torch bypassed the drop-in: no collective call went through it")
    notes.append(f"NCCL files mapped: {mapped}")
    dist.destroy_process_group()
    for n_ in notes:
        print(f"{tag} {n_}", flush=True)
    for f in failures[:40]:
        print(f"{tag} FAIL {f}", flush=True)
    verdict = "PASS" if not failures else f"FAIL ({len(failures)} failures)"
    print(f"SUMMARY {tag} {checks} result checks, {verdict}", flush=True)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
