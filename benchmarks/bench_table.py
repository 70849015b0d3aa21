"""One line per ``bench --out`` JSON of a folder: the table the one-GPU scripts print at the end.

    python3 benchmarks/bench_table.py OUT [GLOB]        (GLOB: which files, default ``*mb*.json``)

Columns: the file's stem, tokens/s/GPU, the median step, the host's own time in ``train_step`` (0 where bench did
not report it), peak allocated and reserved memory (GiB) and the first losses.
"""

from __future__ import annotations

import json
import pathlib
import sys


def main() -> None:
    folder, pattern = pathlib.Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "*mb*.json"
    print(f"{'run':<22}{'tokens/s/GPU':>13}{'step ms':>9}{'host ms':>9}{'alloc':>8}{'reserved':>9}  losses")
    for f in sorted(folder.glob(pattern)):
        d = json.loads(f.read_text())
        print(
            f"{f.stem:<22}{d['tokens_per_s_per_gpu']:>13,.0f}{1000 * d['step_time_s_median']:>9.1f}"
            f"{1000 * (d.get('host_time_s_median') or 0):>9.1f}{d.get('peak_allocated_gib') or 0:>8.2f}"
            f"{d.get('peak_reserved_gib') or 0:>9.2f}  {[round(x, 4) for x in d.get('losses', [])[:6]]}"
        )


if __name__ == "__main__":
    main()
