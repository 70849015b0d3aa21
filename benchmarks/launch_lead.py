"""How far the host runs ahead of the GPU, window by window, from a Chrome trace with CPU ops (``bench --trace``).

    python3 benchmarks/launch_lead.py step.json.gz [--window-ms 10]

For each kernel of the compute stream, its lead is the time from its launch call on the host to its start on the
GPU: a lead near zero means the GPU waited for the host (the host sets the pace there), a lead of milliseconds
means the queue was full (the GPU sets it). Per window of the profiled step: the compute stream's busy share, the
median and minimum lead, the kernels launched, and the top-level host ops of the launching threads by time.
Host times are those of a profiled run (recording CPU ops slows the host), so read them as proportions.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

from host_gaps import load, parts  # this script's folder is on the path when it runs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("--window-ms", type=float, default=10.0)
    p.add_argument("--ops", type=int, default=3, help="host ops named per window")
    args = p.parse_args()
    _, launches, ks, top = parts([e for e in load(args.trace) if e.get("ph") == "X"])
    t0, t1 = ks[0]["ts"], ks[-1]["ts"] + ks[-1]["dur"]
    w = args.window_ms * 1e3
    n = int((t1 - t0) // w) + 1
    busy, leads, count, host = [0.0] * n, [[] for _ in range(n)], [0] * n, [defaultdict(float) for _ in range(n)]
    for k in ks:
        s, t = k["ts"], k["ts"] + k["dur"]
        i = int((s - t0) // w)
        while s < t:
            j = int((s - t0) // w)
            cut = min(t, t0 + (j + 1) * w)
            busy[j] += cut - s
            s = cut
        launch = launches.get(k["args"].get("correlation"))
        if launch is not None:
            leads[i].append((k["ts"] - launch["ts"]) / 1e3)
            count[i] += 1
    launch_threads = {launches[c]["tid"] for c in (k["args"].get("correlation") for k in ks) if c in launches}
    for tid in launch_threads:
        for o in top.get(tid, []):
            s, t = max(o["ts"], t0), min(o["ts"] + o["dur"], t1)
            while s < t:
                j = int((s - t0) // w)
                cut = min(t, t0 + (j + 1) * w)
                host[j][o["name"][:60]] += cut - s
                s = cut
    print(f"compute stream: {len(ks)} kernels over {(t1 - t0) / 1e3:.1f} ms, {args.window_ms:g} ms windows")
    print(f"{'window':>10} {'busy':>5} {'lead med':>8} {'min':>6} {'launches':>8}  top host ops (ms)")
    for i in range(n):
        med = statistics.median(leads[i]) if leads[i] else float("nan")
        lo = min(leads[i]) if leads[i] else float("nan")
        ops = sorted(host[i].items(), key=lambda kv: -kv[1])[: args.ops]
        named = "; ".join(f"{name} {us / 1e3:.1f}" for name, us in ops)
        print(f"{i * args.window_ms:>8.0f}ms {busy[i] / w:>5.0%} {med:>8.2f} {lo:>6.2f} {count[i]:>8}  {named}")
    idle_low_lead = sum(w - busy[i] for i in range(n) if leads[i] and statistics.median(leads[i]) < 0.5)
    print(f"idle in windows with median lead < 0.5 ms (host-paced): {idle_low_lead / 1e3:.1f} ms")


if __name__ == "__main__":
    main()
