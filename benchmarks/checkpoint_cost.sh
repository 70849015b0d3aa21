#!/usr/bin/env bash
# What a checkpoint costs on one GPU, in one device call: the disk's own write rate (dd, and fio when installed),
# the package's CUDA staging test, then `bench` of one layer of the 30B-A3B geometry (15 GB of model + optimizer
# state per rank) saving after steps 10 and 20, synchronously and in the background. Per save bench prints the
# time it blocked the loop, the wait for the earlier write, staging, write time and GB/s per rank.
#   bash benchmarks/checkpoint_cost.sh                 (logs and JSON land in $OUT; saves go to $DIR)
#   DISK=0 bash benchmarks/checkpoint_cost.sh          (the saves only)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DIR=${DIR:-$PWD/bench_checkpoints}; mkdir -p "$DIR"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
R=$(cd "${TREE:-.}" && pwd)
export PYTHONPATH="$(ls -d "$R"/packages/*/src "$R"/apps/*/src | tr '\n' ':')"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
df -h "$DIR" | tail -n 1
free -g | head -n 2
if [ "${DISK:-1}" = 1 ]; then  # DISK=0 leaves out the disk's own rate and the CUDA staging test
  # The disk: 8 GiB written with O_DIRECT and an fsync, one stream, then 8 streams (fio) as the 8 writer threads do.
  dd if=/dev/zero of="$DIR/dd.bin" bs=64M count=128 oflag=direct conv=fsync 2>&1 | tail -n 1
  rm -f "$DIR/dd.bin"
  if command -v fio >/dev/null; then
    fio --name=ckpt --directory="$DIR" --rw=write --bs=4M --size=1G --numjobs=8 --ioengine=psync --direct=1 \
      --end_fsync=1 --group_reporting 2>&1 | grep -E "WRITE:|bw="
    rm -f "$DIR"/ckpt.*
  else
    echo "fio: not installed (dd only)"
  fi
  python3 -m pytest -q -p no:cacheprovider "$R/packages/checkpoint/tests/test_async.py" -k cuda 2>&1 | tail -n 3
fi
bench() {  # bench NAME ARGS...
  local name=$1; shift
  timeout "${T:-280}" python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m moeshard.train bench \
    --model.overrides.num_hidden_layers=1 --steps 22 --checkpoint-every 10 --checkpoint-dir "$DIR/$name" "$@" --out "$OUT/$name.json" 2>&1 \
    | grep -v "UserWarning\|warnings.warn\|_rng_tracker\|AVOID_RECORD\|_warn_once" > "$OUT/$name.log"
  grep -E "^layers|^checkpoint every|^  save after" "$OUT/$name.log" || tail -n 30 "$OUT/$name.log"
}
bench sync
bench async --checkpoint.async=true
