"""Start-up time and memory of one rank reading the prepared token format, for corpora of different sizes.

    python3 benchmarks/data_scaling.py                       # 10M and 200M tokens, rank 0 of 16, seq_len 4096
    python3 benchmarks/data_scaling.py --sizes 10M 1B --dir /scratch/bench

Writes synthetic prepared folders with numpy (no tokenizer: random ids, document lengths from a long-tailed
log-normal with mean ~1k tokens, 64M-token shards), then, in a fresh process per case, measures what rank 0 of a
16-rank job pays: importing moeshard.data, opening the dataset (``open_dataset``), and producing the first steps'
micro-batches (shuffled rows, so reads are scattered over the whole corpus). Memory: the process's resident set
(VmRSS) after each phase and its peak (VmHWM). The issue's targets: the same RSS within 10% across sizes,
start-up under 10 s. ``packing: false`` reads the whole document index at start-up and is shown for comparison.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

VOCAB = 151936
SHARD_TOKENS = 64 << 20


def _tokens(text: str) -> int:
    mult = {"K": 10**3, "M": 10**6, "B": 10**9}
    return int(float(text[:-1]) * mult[text[-1].upper()]) if text[-1].upper() in mult else int(text)


def write_corpus(folder: Path, num_tokens: int, seed: int = 0) -> None:
    """A prepared folder of ``num_tokens`` random tokens in documents of long-tailed lengths."""
    from moeshard.data._format import FORMAT_VERSION, TOKEN_DTYPE, shard_file, write_json
    from moeshard.data._inputs import PREPARED_FORMAT

    if (folder / "header.json").is_file():
        return
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    shards, left, index = [], num_tokens, 0
    while left > 0:
        n = min(SHARD_TOKENS, left)
        # log-normal lengths, mean exp(mu + sigma^2/2) ~ 1000, clipped to [16, 64k]; the last document takes the rest
        lengths = np.clip(rng.lognormal(6.0, 1.4, n // 300 + 16), 16, 65536).astype(np.int64)
        ends = np.cumsum(lengths)
        ends = np.append(ends[ends < n], n)
        for start in range(0, n, 1 << 24):  # 16M tokens at a time: bounded memory while writing
            stop = min(n, start + (1 << 24))
            chunk = rng.integers(0, VOCAB, stop - start, dtype=np.uint32)
            with open(shard_file(folder, index, "tokens"), "ab" if start else "wb") as f:
                chunk.tofile(f)
        ends.tofile(shard_file(folder, index, "docs"))
        shards.append(
            {"index": index, "num_tokens": n, "num_documents": int(ends.size), "fingerprint": f"bench{index}"}
        )
        write_json(shard_file(folder, index, "json"), shards[-1])
        left -= n
        index += 1
    write_json(
        folder / "header.json",
        {
            "format": PREPARED_FORMAT,
            "version": FORMAT_VERSION,
            "dtype": TOKEN_DTYPE,
            "kind": "tokens",
            "has_loss_mask": False,
            "eos_id": 151643,
            "num_tokens": num_tokens,
            "num_documents": sum(s["num_documents"] for s in shards),
            "max_token_id": VOCAB - 1,
            "shards": shards,
            "fingerprint": f"bench-{num_tokens}",
        },
    )


def _status_mib(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _rss_mib() -> float:
    return _status_mib("VmRSS")


def _peak_mib() -> float:
    # VmHWM: the peak of this process image. ru_maxrss would do on a fresh interpreter, but Linux carries it over
    # fork + exec, so it would report the parent's peak (here: the process that wrote the corpus).
    hwm = _status_mib("VmHWM")
    return hwm if hwm == hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(folder: str, packing: bool, world: int, global_batch: int, micro: int, steps: int, seq_len: int) -> dict:
    """One case, in this (fresh) process."""
    t0 = time.perf_counter()
    from moeshard.data import DataConfig, StepBatches, open_dataset

    t_import, rss_import = time.perf_counter() - t0, _rss_mib()
    t1 = time.perf_counter()
    data = open_dataset(DataConfig(path=folder, seq_len=seq_len, packing=packing, shuffle=True), vocab_size=VOCAB)
    sb = StepBatches(data, global_batch=global_batch, world_size=world, micro_batch=micro)
    t_open, rss_open = time.perf_counter() - t1, _rss_mib()
    t2 = time.perf_counter()
    n_tokens = 0
    for step in range(steps):
        n_tokens += sum(b.input_ids.numel() for b in sb.micro_batches(step, rank=0))
    t_batches = time.perf_counter() - t2
    return {
        "import_s": t_import,
        "open_s": t_open,
        "batches_s": t_batches,
        "startup_s": t_open + t_batches,
        "rss_import_mib": rss_import,
        "rss_open_mib": rss_open,
        "rss_mib": _rss_mib(),
        "peak_rss_mib": _peak_mib(),
        "rows": data.sources[0].num_rows,
        "tokens_read": n_tokens,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["10M", "200M"])
    p.add_argument("--dir", default="/tmp/moeshard-data-bench")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--world", type=int, default=16)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--no-padded", action="store_true", help="skip the packing: false cases")
    p.add_argument("--measure", help=argparse.SUPPRESS)
    p.add_argument("--packing", type=int, default=1, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.measure:
        print(
            json.dumps(measure(a.measure, bool(a.packing), a.world, a.global_batch, a.micro_batch, a.steps, a.seq_len))
        )
        return
    rows = []
    for size in a.sizes:
        folder = Path(a.dir) / f"tokens-{size}"
        t = time.perf_counter()
        write_corpus(folder, _tokens(size))
        print(f"corpus {size}: {folder} ({time.perf_counter() - t:.1f} s to write or reuse)", file=sys.stderr)
        for packing in (1,) if a.no_padded else (1, 0):
            cmd = [sys.executable, __file__, "--measure", str(folder), "--packing", str(packing)]
            cmd += ["--seq-len", str(a.seq_len), "--world", str(a.world), "--global-batch", str(a.global_batch)]
            cmd += ["--micro-batch", str(a.micro_batch), "--steps", str(a.steps)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            rows.append((size, "packed" if packing else "padded", json.loads(out.strip().splitlines()[-1])))
    per_rank = a.global_batch // a.world
    print(
        f"\nrank 0 of {a.world}, seq_len {a.seq_len}, {per_rank} rows/step in micro-batches of {a.micro_batch}, "
        f"{a.steps} steps, shuffled\n"
    )
    head = "| corpus | rows | import s | open s | first batches s | start-up s | RSS import MiB | RSS open MiB | RSS after MiB | peak MiB |"
    print(head)
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size, mode, r in rows:
        print(
            f"| {size} {mode} | {r['rows']:,} | {r['import_s']:.2f} | {r['open_s']:.3f} | {r['batches_s']:.3f} | "
            f"{r['startup_s']:.3f} | {r['rss_import_mib']:.0f} | {r['rss_open_mib']:.0f} | {r['rss_mib']:.0f} | "
            f"{r['peak_rss_mib']:.0f} |"
        )


if __name__ == "__main__":
    main()
