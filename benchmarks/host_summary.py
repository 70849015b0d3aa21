"""Where a profiled step's host time goes, from a Chrome trace with CPU activity (``bench --trace`` without
``--trace-gpu-only``).

    python3 benchmarks/host_summary.py step.json.gz [--top 30]

Per host thread with CPU ops (the Python thread runs the forwards and the optimizer; on CUDA autograd runs the
backwards on a thread of its own), the events nested by time: the thread's wall time, the time covered by no op at
all (Python between ops: module calls, hooks, argument checks; on the backward thread also waiting for work), and
the largest ops and annotations by *self* time (their own host time, children excluded) and by inclusive time
(annotations such as FSDP's ``FSDP::pre_forward`` or a compiled region, which contain the ops they launch).
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter, defaultdict


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def by_thread(events: list[dict]) -> dict[tuple, list[dict]]:
    """The CPU ops and annotations of each thread with CPU ops, sorted by start (the busiest thread first)."""
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    counts = Counter((e["pid"], e["tid"]) for e in ops if e.get("cat") == "cpu_op")
    return {
        tid: sorted((e for e in ops if (e["pid"], e["tid"]) == tid), key=lambda e: (e["ts"], -e["dur"]))
        for tid, _ in counts.most_common()
    }


def summarise(events: list[dict], top: int) -> None:
    self_us, incl_us, calls = defaultdict(float), defaultdict(float), Counter()
    stack: list[list] = []  # [end, name, time in children, duration]
    covered, cover_end = 0.0, None
    start = events[0]["ts"] if events else 0
    end = max((e["ts"] + e["dur"] for e in events), default=start)
    for e in events:
        t0, t1, name = e["ts"], e["ts"] + e["dur"], e["name"]
        while stack and stack[-1][0] <= t0:
            _end, s_name, s_child, s_dur = stack.pop()
            self_us[s_name] += s_dur - s_child
        if stack:
            stack[-1][2] += e["dur"]
        else:  # a top-level event: host time covered by some op
            covered += e["dur"] if cover_end is None or t0 >= cover_end else max(0.0, t1 - cover_end)
            cover_end = t1 if cover_end is None else max(cover_end, t1)
        stack.append([t1, name, 0.0, e["dur"]])
        incl_us[name] += e["dur"]
        calls[name] += 1
    for _end, s_name, s_child, s_dur in stack:
        self_us[s_name] += s_dur - s_child
    wall = end - start
    print(
        f"  wall {wall / 1e3:.1f} ms, inside ops {covered / 1e3:.1f} ms, outside any op {(wall - covered) / 1e3:.1f} ms"
    )
    print("  by self time:")
    for name, us in sorted(self_us.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {us / 1e3:8.2f} ms {calls[name]:6d}x  {name[:100]}")
    print("  annotations by inclusive time:")
    notes = [n for n in incl_us if "::" in n and not n.startswith("aten::") or n.startswith(("Torch-Compiled", "##"))]
    for name in sorted(notes, key=lambda n: -incl_us[n])[:top]:
        print(f"    {incl_us[name] / 1e3:8.2f} ms {calls[name]:6d}x  {name[:100]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    for (pid, tid), events in by_thread(load(args.trace)).items():
        engine = sum(e["name"].startswith("autograd::engine") for e in events)
        print(f"thread {pid}/{tid}: {len(events)} events, {engine} of them autograd-engine (backward) functions")
        summarise(events, args.top)


if __name__ == "__main__":
    main()
