source benchmarks/gpu_env.sh
b() { n=$1; shift; timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m moeshard.train bench --layers 8 --compile --ep-size 1 --batch-per-gpu 4 --steps 14 --warmup 5 "$@" --out $OUT/$n.json 2>&1 | grep -v "Warning\|warn" > /tmp/$n.log; echo "$n: $(tail -n 1 /tmp/$n.log)"; grep -q "tok/s" /tmp/$n.log || tail -20 /tmp/$n.log; }
b mb1_last --micro-batch 1 --gradient-sync last_micro_batch
b mb1_last_nraf --micro-batch 1 --gradient-sync last_micro_batch --no-reshard-after-forward
b mb4_nraf --micro-batch 4 --no-reshard-after-forward
sed -i 's/            model.set_requires_gradient_sync(m == last)/            model.set_requires_gradient_sync(m == last)\n            model.set_reshard_after_backward(m == last)/' apps/train/src/moeshard/train/train.py
grep -n "set_reshard_after_backward" apps/train/src/moeshard/train/train.py
b mb1_last_nraf_nrab --micro-batch 1 --gradient-sync last_micro_batch --no-reshard-after-forward
b mb2_last_nraf_nrab --micro-batch 2 --gradient-sync last_micro_batch --no-reshard-after-forward
b mb1_last_nraf_nrab_trace --micro-batch 1 --gradient-sync last_micro_batch --no-reshard-after-forward --steps 8 --warmup 4 --trace /tmp/t.json.gz --trace-gpu-only
python3 benchmarks/trace_summary.py /tmp/t.json.gz --top 25 > $OUT/trace_mb1_best.txt 2>&1
