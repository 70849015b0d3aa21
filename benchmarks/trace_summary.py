"""Where a profiled step's GPU time goes, from a Chrome trace (``moeshard-train bench --trace step.json.gz``).

    python3 benchmarks/trace_summary.py step.json.gz [--top 40] [--skip-ms 300] [--steps-between adamw]

``--skip-ms`` leaves out the kernels that start in the trace's first milliseconds. ``bench --trace`` already leaves
out the first step after its timed loop, which starts from an empty launch queue (``--trace-warmup``, default 1);
for a trace made with ``--trace-warmup 0``, about one step's length leaves that step out here, and the figures are
then those of the steady steps after it. ``--steps-between adamw`` keeps exactly the whole steps between the first and
last optimizer ends in the trace (a window of N traced steps can hold parts of N + 1 optimizer passes, the host
running ahead of the GPU) and gives the categories per step too.

Prints: the step's GPU span; per stream, the busy time (union of its kernels); the compute stream's idle time
split into "waiting while a collective runs" (exposed communication) and "nothing runs at all" (launch gaps,
host syncs); kernel time by category; the largest kernels by total time; the longest idle gaps of the compute
stream with the kernels on either side; which host ops launched the memory-bound kernels (kernel time by the
chain of CPU ops around each launch) and which launches the compute stream waited for (idle time before a kernel,
by the chain of CPU ops that launched it).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict

CATEGORIES = [
    ("all-to-all / NCCL", r"nccl"),
    ("attention", r"fmha|flash|sdpa|attention|cudnn"),
    ("grouped GEMM", r"group"),
    ("GEMM", r"gemm|nvjet|xmma|cutlass|matmul|cublas"),
    ("AdamW", r"adam"),
    ("compiled (triton)", r"triton"),
    ("sort / scan", r"sort|radix|scan|cub::"),
    ("gather / index", r"index|gather|scatter"),
    ("copy / cast", r"copy|memcpy|cat|chunk|memset|fill"),
    ("reduce", r"reduce"),
    ("elementwise (eager)", r"elementwise|vectorized"),
]


def category(name: str) -> str:
    low = name.lower()
    for cat, pattern in CATEGORIES:
        if re.search(pattern, low):
            return cat
    return "other"


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def launch_chains(events: list[dict], depth: int = 4) -> dict[int, str]:
    """Kernel correlation id -> the CPU ops around its launch, outermost first (last ``depth`` levels)."""
    per_thread: dict[object, list[tuple[float, int, dict]]] = defaultdict(list)
    for e in events:
        if e.get("ph") != "X":
            continue
        if e.get("cat") == "cpu_op":
            per_thread[(e.get("pid"), e.get("tid"))].append((e["ts"], 0, e))
        elif e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {}):
            per_thread[(e.get("pid"), e.get("tid"))].append((e["ts"], 1, e))
    chains: dict[int, str] = {}
    for evs in per_thread.values():
        evs.sort(key=lambda x: (x[0], x[1], -x[2].get("dur", 0)))
        stack: list[dict] = []
        for ts, kind, e in evs:
            while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) < ts:
                stack.pop()
            if kind == 0:
                stack.append(e)
            else:
                names = [o["name"].replace("autograd::engine::evaluate_function: ", "bwd:") for o in stack]
                chains[e["args"]["correlation"]] = " > ".join(n[:48] for n in names[-depth:]) or "(no op)"
    return chains


def between_passes(kernels: list[dict], pattern: str, gap_us: float = 2e4) -> tuple[list[dict], int]:
    """The kernels from the end of the first optimizer pass to the end of the last, and the whole steps between.

    A pass is a run of kernels whose names match ``pattern`` (case-insensitive) with less than ``gap_us`` between one's
    end and the next one's start. A trace's window rarely starts or ends at a step's boundary (``bench --trace``
    records what runs while its active steps are launched, and the host runs ahead of the GPU), so a trace of N steps
    can hold parts of N + 1 optimizer passes; the kernels between two passes' ends are whole steps."""
    regex = re.compile(pattern, re.IGNORECASE)
    ends: list[float] = []
    last_end = None
    for k in sorted((k for k in kernels if regex.search(k["name"])), key=lambda k: k["ts"]):
        if last_end is not None and k["ts"] - last_end >= gap_us:
            ends.append(last_end)
        last_end = k["ts"] + k["dur"] if last_end is None else max(last_end, k["ts"] + k["dur"])
    if last_end is not None:
        ends.append(last_end)
    if len(ends) < 2:
        raise SystemExit(f"--steps-between {pattern!r}: {len(ends)} optimizer pass(es) in the trace, 2 needed")
    start, stop = ends[0], ends[-1]
    return [k for k in kernels if k["ts"] >= start and k["ts"] + k["dur"] <= stop], len(ends) - 1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--window-ms", type=float, default=10.0, help="the compute stream's idle time per window")
    p.add_argument("--skip-ms", type=float, default=0.0, help="leave out the kernels that start this early")
    p.add_argument(
        "--steps-between",
        metavar="REGEX",
        help="keep only the whole steps between the ends of the first and last optimizer passes, a pass being the "
        "kernels whose names match REGEX (e.g. adamw) with no gap of 20 ms or more among them; figures are then "
        "also given per step",
    )
    args = p.parse_args()
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    kernels = [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("dur", 0) > 0
    ]
    if kernels and args.skip_ms > 0:
        start = min(k["ts"] for k in kernels) + 1e3 * args.skip_ms
        kernels = [k for k in kernels if k["ts"] >= start]
    if not kernels:
        raise SystemExit(
            "no GPU kernels in the trace" + (f" after its first {args.skip_ms} ms" if args.skip_ms else "")
        )
    steps = 1
    if args.steps_between:
        kernels, steps = between_passes(kernels, args.steps_between)
    by_stream: dict[object, list[dict]] = defaultdict(list)
    for k in kernels:
        by_stream[(k.get("pid"), k.get("tid"))].append(k)
    t0 = min(k["ts"] for k in kernels)
    t1 = max(k["ts"] + k["dur"] for k in kernels)
    span = t1 - t0
    print(f"GPU span {span / 1e3:.1f} ms, {len(kernels)} kernels")
    if args.steps_between:
        print(f"  {steps} whole step(s) between optimizer ends: {span / 1e3 / steps:.1f} ms per step")
    busy = {}
    for sid, ks in by_stream.items():
        busy[sid] = union_length([(k["ts"], k["ts"] + k["dur"]) for k in ks])
        nccl = sum(k["dur"] for k in ks if "nccl" in k["name"].lower())
        print(f"  stream {sid}: {len(ks)} kernels, busy {busy[sid] / 1e3:.1f} ms (NCCL {nccl / 1e3:.1f} ms)")
    compute_sid = max(by_stream, key=lambda s: sum(k["dur"] for k in by_stream[s] if "nccl" not in k["name"].lower()))
    compute = merged([(k["ts"], k["ts"] + k["dur"]) for k in by_stream[compute_sid]])
    comm = merged([(k["ts"], k["ts"] + k["dur"]) for k in kernels if "nccl" in k["name"].lower()])
    other = merged(
        [
            (k["ts"], k["ts"] + k["dur"])
            for sid, ks in by_stream.items()
            if sid != compute_sid
            for k in ks
            if "nccl" not in k["name"].lower()
        ]
    )
    # idle intervals of the compute stream inside the span
    idle, cur = [], t0
    for s, e in compute:
        if s > cur:
            idle.append((cur, s))
        cur = max(cur, e)
    if t1 > cur:
        idle.append((cur, t1))

    def covered(iv: tuple[float, float], by: list[tuple[float, float]]) -> float:
        s, e = iv
        return sum(max(0.0, min(e, b) - max(s, a)) for a, b in by if a < e and b > s)

    idle_total = sum(e - s for s, e in idle)
    idle_comm = sum(covered(iv, comm) for iv in idle)
    idle_other = sum(covered(iv, other) for iv in idle)
    print(
        f"compute stream {compute_sid}: busy {busy[compute_sid] / 1e3:.1f} ms, idle {idle_total / 1e3:.1f} ms "
        f"(of which a collective runs {idle_comm / 1e3:.1f} ms, other streams' compute {idle_other / 1e3:.1f} ms, "
        f"nothing ~{(idle_total - idle_comm - idle_other) / 1e3:.1f} ms)"
    )
    cats: dict[str, float] = defaultdict(float)
    names: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for k in kernels:
        cats[category(k["name"])] += k["dur"]
        names[k["name"]][0] += k["dur"]
        names[k["name"]][1] += 1
    print("kernel time by category (all streams):")
    for cat, t in sorted(cats.items(), key=lambda x: -x[1]):
        print(f"  {cat:22s} {t / 1e3:8.1f} ms" + (f"  ({t / 1e3 / steps:.2f} ms per step)" if steps > 1 else ""))
    print(f"top {args.top} kernels:")
    for name, (t, n) in sorted(names.items(), key=lambda x: -x[1][0])[: args.top]:
        per_step = f" ({n / steps:g}/step)" if steps > 1 else ""
        print(f"  {t / 1e3:7.2f} ms {int(n):5d}x{per_step}  {name[:150]}")
    chains = launch_chains(events)
    memory_bound = {"elementwise (eager)", "copy / cast", "gather / index", "reduce", "other", "sort / scan"}
    by_chain: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for k in kernels:
        cat = category(k["name"])
        if cat in memory_bound:
            key = (cat, chains.get(k.get("args", {}).get("correlation"), "(unknown launch)"))
            by_chain[key][0] += k["dur"]
            by_chain[key][1] += 1
    print(f"memory-bound eager kernels by launching CPU ops (top {args.top}):")
    for (cat, chain), (t, n) in sorted(by_chain.items(), key=lambda x: -x[1][0])[: args.top]:
        print(f"  {t / 1e3:7.2f} ms {int(n):5d}x  {cat:20s} {chain[:160]}")
    waited: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    idle_end = {e: e - s for s, e in idle}
    for k in by_stream[compute_sid]:
        gap = idle_end.get(k["ts"])
        if gap is not None and gap > 5:
            chain = chains.get(k.get("args", {}).get("correlation"), "(unknown launch)")
            waited[chain][0] += gap
            waited[chain][1] += 1
    print("compute-stream idle (gaps > 5 us) by the launch it waited for:")
    for chain, (t, n) in sorted(waited.items(), key=lambda x: -x[1][0])[:25]:
        print(f"  {t / 1e3:7.2f} ms {int(n):5d}x  {chain[:170]}")
    w = args.window_ms * 1e3
    per_window: dict[int, float] = defaultdict(float)
    for s, e in idle:
        a = s
        while a < e:
            b = min(e, t0 + ((a - t0) // w + 1) * w)
            per_window[int((a - t0) // w)] += b - a
            a = b
    print(f"compute-stream idle per {args.window_ms:g} ms window (forward, backward, optimizer in turn):")
    print("  " + " ".join(f"{per_window.get(i, 0.0) / 1e3:.1f}" for i in range(int(span // w) + 1)))
    starts = {k["ts"]: k["name"] for k in by_stream[compute_sid]}
    ends = {k["ts"] + k["dur"]: k["name"] for k in by_stream[compute_sid]}
    print("longest idle gaps of the compute stream:")
    for s, e in sorted(idle, key=lambda iv: iv[0] - iv[1])[:15]:
        before = ends.get(s, "(span start)")[:60]
        after = starts.get(e, "(span end)")[:60]
        print(
            f"  {(e - s) / 1e3:6.2f} ms at +{(s - t0) / 1e3:6.1f} ms  comm {covered((s, e), comm) / 1e3:5.2f}  "
            f"after {before!r} before {after!r}"
        )


if __name__ == "__main__":
    main()
