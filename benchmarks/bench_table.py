"""One line per ``bench --out`` JSON of a folder: the table the one-GPU scripts print at the end.

    python3 benchmarks/bench_table.py OUT [GLOB]        (GLOB: which files, default ``*mb*.json``)

Columns: the file's stem, tokens/s/GPU, the median step, the host's own time in ``train_step`` (0 where bench did
not report it), peak allocated and reserved memory (GiB) and the first losses. Runs repeated in rounds
(``regimes_1gpu.sh`` with ``ROUNDS``: stems ending ``_r1``, ``_r2``, ...) get one more line each: the median step over
the rounds and its range.
"""

from __future__ import annotations

import json
import pathlib
import re
import statistics
import sys
from collections import defaultdict


def main() -> None:
    folder, pattern = pathlib.Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "*mb*.json"
    print(f"{'run':<22}{'tokens/s/GPU':>13}{'step ms':>9}{'host ms':>9}{'alloc':>8}{'reserved':>9}  losses")
    rounds: dict[str, list[float]] = defaultdict(list)
    for f in sorted(folder.glob(pattern)):
        d = json.loads(f.read_text())
        repeated = re.fullmatch(r"(.+)_r\d+", f.stem)
        if repeated:
            rounds[repeated.group(1)].append(1000 * d["step_time_s_median"])
        print(
            f"{f.stem:<22}{d['tokens_per_s_per_gpu']:>13,.0f}{1000 * d['step_time_s_median']:>9.1f}"
            f"{1000 * (d.get('host_time_s_median') or 0):>9.1f}{d.get('peak_allocated_gib') or 0:>8.2f}"
            f"{d.get('peak_reserved_gib') or 0:>9.2f}  {[round(x, 4) for x in d.get('losses', [])[:6]]}"
        )
    for name, steps in sorted(rounds.items()):
        print(
            f"{name:<22} median step over {len(steps)} rounds {statistics.median(steps):.1f} ms "
            f"({min(steps):.1f}-{max(steps):.1f})"
        )


if __name__ == "__main__":
    main()
