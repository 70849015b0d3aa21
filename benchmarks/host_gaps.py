"""What the host did while the GPU's compute stream idled, from a Chrome trace with CPU ops (``bench --trace``).

    python3 benchmarks/host_gaps.py step.json.gz [--top 20] [--min-gap-ms 0.3]

For each idle gap of the compute stream longer than ``--min-gap-ms`` that no collective explains, the host time
between the launch of the kernel before the gap and the launch of the kernel after it, split into the top-level
CPU ops of the launching thread in that interval (by name, summed), and the launch's lag: how long after the gap's
start the kernel after it was launched (positive: the host was behind, it paced the gap; negative: the kernel was
queued in time and the gap is the device's own). Then the same summed over all such gaps.
Host times are those of a profiled run (recording CPU ops slows the host), so read them as proportions.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import defaultdict


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def parts(ev: list[dict]) -> tuple[list[dict], dict, list[dict], dict]:
    """Of a trace's complete events: the GPU events, the launch calls by correlation id, the compute stream's
    kernels in time order (the stream with the most non-NCCL kernel time) and each host thread's top-level CPU ops."""
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("dur", 0) > 0]
    launches = {
        e["args"]["correlation"]: e
        for e in ev
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    by_stream = defaultdict(list)
    for e in gpu:
        by_stream[(e["pid"], e["tid"])].append(e)
    compute = max(by_stream, key=lambda k: sum(x["dur"] for x in by_stream[k] if "nccl" not in x["name"].lower()))
    by_thread = defaultdict(list)
    for e in ev:
        if e.get("cat") in ("cpu_op", "user_annotation"):
            by_thread[e["tid"]].append(e)
    top_level = {}
    for tid, ops in by_thread.items():
        ops.sort(key=lambda e: (e["ts"], -e["dur"]))
        out, end = [], float("-inf")
        for e in ops:
            if e["ts"] >= end:
                out.append(e)
                end = e["ts"] + e["dur"]
        top_level[tid] = out
    return gpu, launches, sorted(by_stream[compute], key=lambda e: e["ts"]), top_level


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--min-gap-ms", type=float, default=0.3)
    args = p.parse_args()
    ev = [e for e in load(args.trace) if e.get("ph") == "X"]
    gpu, launches, ks, top_level = parts(ev)
    comm = sorted((e["ts"], e["ts"] + e["dur"]) for e in gpu if "nccl" in e["name"].lower())

    def comm_overlap(s: float, t: float) -> float:
        return sum(max(0.0, min(t, b) - max(s, a)) for a, b in comm if a < t and b > s)

    gaps = []
    for a, b in zip(ks, ks[1:]):
        gap = b["ts"] - (a["ts"] + a["dur"])
        if gap / 1e3 < args.min_gap_ms or comm_overlap(a["ts"] + a["dur"], b["ts"]) > 0.5 * gap:
            continue
        la, lb = launches.get(a["args"].get("correlation")), launches.get(b["args"].get("correlation"))
        if la is None or lb is None or la["tid"] != lb["tid"]:
            continue
        gaps.append((gap, a, b, la, lb))
    gaps.sort(key=lambda g: -g[0])
    total = defaultdict(float)
    t0 = ks[0]["ts"]
    print(f"{len(gaps)} host-bound gaps > {args.min_gap_ms} ms, {sum(g[0] for g in gaps) / 1e3:.1f} ms in all")
    for i, (gap, a, b, la, lb) in enumerate(gaps):
        ops = top_level.get(la["tid"], [])
        lo = bisect.bisect_left([o["ts"] for o in ops], la["ts"])
        spent = defaultdict(float)
        for o in ops[max(0, lo - 1) :]:
            if o["ts"] >= lb["ts"]:
                break
            s, t = max(o["ts"], la["ts"]), min(o["ts"] + o["dur"], lb["ts"])
            if t > s:
                spent[o["name"]] += t - s
                total[o["name"]] += t - s
        outside = (lb["ts"] - la["ts"]) - sum(spent.values())
        spent["(no op: Python between ops)"] += outside
        total["(no op: Python between ops)"] += outside
        if i < args.top:
            host, lag = (lb["ts"] - la["ts"]) / 1e3, (lb["ts"] - (a["ts"] + a["dur"])) / 1e3
            print(
                f"\n{gap / 1e3:.2f} ms idle at +{(a['ts'] + a['dur'] - t0) / 1e3:.1f} ms; host {host:.2f} ms between "
                f"launches of '{a['name'][:50]}' and '{b['name'][:50]}', the second launched {lag:+.2f} ms after "
                "the gap's start"
            )
            for name, us in sorted(spent.items(), key=lambda kv: -kv[1])[:8]:
                print(f"    {us / 1e3:6.2f} ms  {name[:100]}")
    print("\nsummed over all gaps (top-level host ops between the two launches):")
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {us / 1e3:7.2f} ms  {name[:110]}")


if __name__ == "__main__":
    main()
