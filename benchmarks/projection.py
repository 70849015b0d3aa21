"""A 48-layer throughput and memory projection for Qwen3-30B-A3B on 8×H200 (EP 8) and 2×8 H200 (EP 8 × ep_fsdp 2).

    python benchmarks/projection.py

A projection from the measurements quoted below, not a measurement (issue 21, item 7): per-layer compute from the
8- and 16-layer runs (a line through two points), the token exchange and the inter-node FSDP traffic from measured
or given bandwidths, memory from ``moeshard-train plan`` (run in-process on the fake backend, no GPU). Every run
quoted moves 4 × 4096 tokens per GPU per step; so does every projected row.
"""

from __future__ import annotations

import functools
import math

from moeshard.train.commands.plan import plan_report
from moeshard.train.commands.plan_memory import GiB
from moeshard.train.config import load_config, resolve_model_config
from moeshard.train.observe.comm import a2a_rows_per_token

# ---- Measured inputs (tokens/s/GPU unless said) -----------------------------------------------------------------
TOKENS = 4 * 4096  # tokens per GPU per step, every run below
# Issue 21's table: 2×H200, torch 2.11, --compile, EP 2, 16 layers; and its peak reserved GiB.
EP2_16L = {"mb 4x1, full AC": 30_608, "mb 2x2, no AC": 31_742, "mb 1x4, no AC": 19_546}
EP2_16L_RESERVED_GIB = {"mb 4x1, full AC": 88.4, "mb 2x2, no AC": 114.8, "mb 1x4, no AC": 104.8}
# NOTES.md "Micro-batches and activation checkpointing at one GPU" (1×H200, 8 layers, EP 1): peak allocated GiB.
ONE_GPU_ALLOCATED_GIB = {(4, False): 95.3, (2, False): 98.0, (1, False): 92.3, (4, True): 86.0, (1, True): 87.9}
# Issue 21: the same at 8 layers, no checkpointing.
EP2_8L = {"mb 4x1, no AC": 67_768, "mb 2x2, no AC": 52_164, "mb 1x4, no AC": 33_303}
# Issue 21 and PERF_FACTS.md: 8 layers, EP 2 against EP 1 × ep_fsdp 2 (experts dim-1 sharded over NVLink).
EP2_8L_REF, EP1_EFSDP2_8L = 66_800, (52_800 + 53_900) / 2
# NOTES.md "Micro-batches and activation checkpointing at one GPU" (1×H200, 8 layers, EP 1): step ms at mb 4x1.
ONE_GPU_NO_AC_MS, ONE_GPU_FULL_AC_MS = 240.4, 280.7
# NOTES.md "Where v17's time goes" (EP 2, 8 layers): grouped expert GEMM kernel time per step, forward + backward.
GROUPED_GEMM_MS_8L = 64.9
# NOTES.md "Where v16's time goes": the fused local-expert AdamW update per step (EP 2, 8 layers, 2.42 G params/rank);
# "The core refactor": what it saved against torch's AdamW in the same call.
FUSED_UPDATE_MS_8L, UNFUSED_EXTRA_MS_8L, EXPERT_PARAMS_8L_EP2 = 16.9, 11.0, 2.42e9
# PERF_FACTS.md: NCCL all-to-all, bytes leaving each GPU per second, by buffer size (MiB -> GB/s), on 2×H200 (NV18).
A2A_GBPS = {8: 65, 64: 239, 512: 295}
INTER_NODE_GBPS = 50  # issue 21: the inter-node link, per GPU per direction
NEMO_TOKS = 12_040  # issue 21: the published reference, 8×H100 (NeMo)
PEAK_FLOPS = 989e12  # H200 dense bf16 datasheet, the project's MFU denominator
# ---- Stated assumptions -----------------------------------------------------------------------------------------
LAYERS = 48
BUDGET_GIB = 125  # of the H200's 141 GiB
OVERLAP_WHAT_IF = 0.5  # a what-if: this fraction of the EP 8 exchange hidden (a schedule that overlaps more)
FORWARD_SHARE = 1 / 3  # of a layer's compute without checkpointing (backward = 2 × forward); with it 1/4
# policy -> (micro-batch, full activation checkpointing); "alt": mb 2x2 with the AC line's fixed part (see main)
POLICIES = {
    "mb 4x1, full AC": (4, True),
    "mb 2x2, no AC": (2, False),
    "mb 2x2, no AC, alt": (2, False),
    "mb 1x4, no AC": (1, False),
}
LAYOUTS = {"1×8, EP 8": 1, "2×8, EP 8 × ep_fsdp 2": 2}  # -> nodes of 8 H200s


def step_ms(tokens_per_s: float) -> float:
    return TOKENS / tokens_per_s * 1e3


def a2a_gbps(mib: float) -> float:
    """PERF_FACTS' all-to-all rate, interpolated on log2(buffer size) between the measured sizes."""
    sizes = sorted(A2A_GBPS)
    mib = min(max(mib, sizes[0]), sizes[-1])
    for lo, hi in zip(sizes, sizes[1:]):
        if mib <= hi:
            t = math.log2(mib / lo) / math.log2(hi / lo)
            return A2A_GBPS[lo] + t * (A2A_GBPS[hi] - A2A_GBPS[lo])
    return A2A_GBPS[sizes[-1]]


@functools.cache
def job(layers: int, ep: int, nodes: int, nproc: int, mb: int, ac: bool):
    """The job of a projected (or measured) row, as `moeshard-train plan --config` would read it."""
    keys = {
        "model.preset": "qwen3-30b-a3b",
        "model.overrides.num_hidden_layers": layers,
        "parallel.param_dtype": "bfloat16",
        "parallel.ep_size": ep,
        "data.seq_len": 4096,
        "train.global_batch_size": 4 * nodes * nproc,
        "train.micro_batch_size": mb,
        "parallel.activation_checkpointing": "full" if ac else "none",
        "parallel.compile": "true",
        "parallel.ep.kernels": "triton",
    }
    cfg = load_config(None, [f"{k}={v}" for k, v in keys.items()])
    return cfg, plan_report(cfg, nnodes=nodes, nproc_per_node=nproc, table=False)


def memory_gib(layers: int, ep: int, nodes: int, nproc: int, mb: int, ac: bool) -> float:
    """plan's total: it counts the bf16 gradients of experts under the fused update (ep_fsdp 1) and, with several
    micro-batches, the gradients alive beside the last one's activations."""
    return job(layers, ep, nodes, nproc, mb, ac)[1].memory.total / GiB


def flops_per_token(c) -> float:
    """The project's formula: 6 × active matmul parameters + causal attention 6·L·2·(S/2)·(heads·head_dim)."""
    d, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = d * q + 2 * d * kv + q * d + d * c.num_experts + c.num_experts_per_tok * 3 * d * c.moe_intermediate_size
    return 6 * (c.num_hidden_layers * layer + d * c.vocab_size) + 6 * c.num_hidden_layers * 2 * (4096 / 2) * q


def row(name: str, *cells) -> str:
    return "  ".join([f"{name:<42}"] + [f"{c:>13}" if isinstance(c, str) else f"{c:>13,.1f}" for c in cells])


def main() -> None:
    print("A PROJECTION from the quoted measurements, not a measurement.\n")
    # 1. Per-layer compute: a line through the 8- and 16-layer steps (EP 2, 2×H200).
    ac_ratio = ONE_GPU_FULL_AC_MS / ONE_GPU_NO_AC_MS
    at8 = {
        "mb 4x1, full AC": step_ms(EP2_8L["mb 4x1, no AC"]) * ac_ratio,  # 8 layers with AC were not run at EP 2
        "mb 2x2, no AC": step_ms(EP2_8L["mb 2x2, no AC"]),
        "mb 1x4, no AC": step_ms(EP2_8L["mb 1x4, no AC"]),
    }
    fits = {}
    print("1. Compute per step at EP 2 (ms): step = fixed + layers × per-layer, through the 8- and 16-layer steps")
    print(row("policy", "8 layers", "16 layers", "fixed", "per layer", "48 layers"))
    for p in POLICIES:
        b = step_ms(EP2_16L[p.removesuffix(", alt")])
        if p.endswith("alt"):  # the AC line's fixed part, the 16-layer step alone for the per-layer time
            fits[p] = fits["mb 4x1, full AC"][0], (b - fits["mb 4x1, full AC"][0]) / 16
        else:
            per_layer = (b - at8[p]) / 8
            fits[p] = at8[p] - 8 * per_layer, per_layer
        print(row(p, "-" if p.endswith("alt") else at8[p], b, *fits[p], fits[p][0] + LAYERS * fits[p][1]))
    print(f"   (full AC at 8 layers: the EP 2 no-AC step × {ac_ratio:.3f}, the 1-GPU full/no AC ratio at mb 4x1;")
    print("    alt: the 8-layer mb 2x2 step looks slow (+30% over mb 4x1 against +10% at one GPU), so its fixed part")
    print("    is taken from the AC line and its per-layer time from the 16-layer step alone)\n")

    # 2a. The EP 8 token exchange per layer and step: dispatch + combine, forward (twice with AC) and backward.
    c = resolve_model_config(job(LAYERS, 8, 1, 8, 4, False)[0])
    row_bytes = c.hidden_size * 2  # one routed copy, bf16
    gemm_per_layer = GROUPED_GEMM_MS_8L / 8
    print("2a. EP token exchange per layer per step (copies: top-k × hidden × 2 B each way, uniform routing)")
    print(row("EP, policy", "MiB per pass", "GB/s", "exchange ms", "hideable ms", "exposed ms"))
    exchange = {}
    for ep, p in [(2, "mb 4x1, no AC")] + [(8, p) for p in POLICIES]:
        mb, ac = POLICIES.get(p, (4, False))
        per_pass = mb * 4096 * a2a_rows_per_token(c, ep) * row_bytes
        gbps = a2a_gbps(per_pass / 2**20)
        ms = (6 if ac else 4) * (4 // mb) * per_pass / gbps / 1e6
        hide = gemm_per_layer / ep * (4 / 3 if ac else 1)  # the own copies' expert GEMM runs beside the exchange
        exchange[(ep, p)] = (ms, max(0.0, ms - hide))
        if not p.endswith("alt"):
            print(row(f"EP {ep}, {p}", per_pass / 2**20, gbps, ms, hide, max(0.0, ms - hide)))
    print("   (hideable: the own copies' expert GEMM (1/EP of the rows) that runs beside the exchange; the EP 2 row is")
    print("    a check: the v17 trace measured ~0.7 ms exposed per layer, already inside the EP 2 lines of table 1)\n")

    # 2b. 2×8: inter-node FSDP traffic (plan's estimate) against the layer's compute, forward and backward.
    print(f"2b. 2×8: inter-node bytes per step from plan, at {INTER_NODE_GBPS} GB/s per GPU, against the compute")
    print(row("policy", "GB/step", "ms/step", "fwd comm/cmp", "bwd comm/cmp", "exposed ms"))
    inter = {}
    for p, (mb, ac) in POLICIES.items():
        comm = job(LAYERS, 8, 2, 8, mb, ac)[1].comm
        ag, rs = comm.get(("all_gather", "inter-node"), 0.0), comm.get(("reduce_scatter", "inter-node"), 0.0)
        per_mb_layer = fits[p][1] * mb / 4  # compute ms of one layer per micro-batch
        fwd_share = 1 / 4 if ac else FORWARD_SHARE
        n_mb = 4 // mb
        fwd = ag / 2 / n_mb / LAYERS / INTER_NODE_GBPS / 1e6, per_mb_layer * fwd_share
        bwd = (ag / 2 + rs) / n_mb / LAYERS / INTER_NODE_GBPS / 1e6, per_mb_layer * (1 - fwd_share)
        # the step's edges: the embedding's first all-gather (bf16) and its gradient's reduce-scatter (fp32)
        # before the clip, half of each to the other node's ranks
        edge = c.vocab_size * c.hidden_size * (2 + 4) / 2 / INTER_NODE_GBPS / 1e6
        late = LAYERS * n_mb * (max(0.0, fwd[0] - fwd[1]) + max(0.0, bwd[0] - bwd[1]))
        inter[p] = edge + late
        print(row(p, (ag + rs) / 1e9, (ag + rs) / INTER_NODE_GBPS / 1e6, fwd[0] / fwd[1], bwd[0] / bwd[1], edge + late))
    print("   (comm/cmp < 1: hidden behind the layer with prefetch, if the collectives do not slow the compute)\n")

    # 3. Memory per GPU from plan, first at the measured points, to calibrate it.
    print("3. Memory per GPU (GiB): plan's total, the measured peak, and reserved projected as plan + the 16-layer")
    print("   reserved gap")
    print(row("layout, policy", "plan total", "measured", "reserved"))
    for (mb, ac), gib in ONE_GPU_ALLOCATED_GIB.items():
        label = f"1 GPU, 8 layers, mb {mb}x{4 // mb}, {'full' if ac else 'no'} AC"
        print(row(label, memory_gib(8, 1, 1, 1, mb, ac), f"{gib} al."))
    gap = {}
    for p, gib in EP2_16L_RESERVED_GIB.items():
        total = memory_gib(16, 2, 1, 2, *POLICIES[p])
        gap[POLICIES[p]] = gib - total
        print(row(f"16 layers, EP 2, {p}", total, f"{gib} res."))
    memory = {}
    for name, nodes in LAYOUTS.items():
        for p, (mb, ac) in POLICIES.items():
            total = memory_gib(LAYERS, 8, nodes, 8, mb, ac)
            memory[(name, p)] = total + gap[(mb, ac)]
            if not p.endswith("alt"):
                print(row(f"{name}, {p}", total, "", memory[(name, p)]))
    print("   (al.: peak allocated; res.: peak reserved; the gap is taken per policy from the 16-layer rows)\n")

    # 4. The projection: EP 2 compute fit, re-priced for the layout's expert update, its FSDP copies and its traffic.
    fused_ms_per_param = FUSED_UPDATE_MS_8L / EXPERT_PARAMS_8L_EP2
    unfused_ms_per_param = (FUSED_UPDATE_MS_8L + UNFUSED_EXTRA_MS_8L) / EXPERT_PARAMS_8L_EP2
    expert_layer = c.num_experts * 3 * c.hidden_size * c.moe_intermediate_size
    # experts under FSDP (ep_fsdp 2): copies and casts per gathered expert element, from EP 1 × ep_fsdp 2 against
    # EP 2 at 8 layers over NVLink, less the unfused update (a lower bound: EP 2 pays for its exchange there)
    fsdp_gathered_8l = 8 * expert_layer * 2
    fsdp_ms_per_elem = (step_ms(EP1_EFSDP2_8L) - step_ms(EP2_8L_REF) - UNFUSED_EXTRA_MS_8L) / fsdp_gathered_8l
    print("4a. The 48-layer step (ms): EP 2 compute line, re-priced expert update, FSDP copies, exposed traffic")
    print(row("layout, policy", "EP 2 line", "update", "FSDP copies", "inter-node", "EP 8 exch.", "step"))
    steps = {}
    for name, nodes in LAYOUTS.items():
        local = LAYERS * expert_layer / 8 / nodes  # local expert parameters per GPU
        update = local * (fused_ms_per_param if nodes == 1 else unfused_ms_per_param) - LAYERS * FUSED_UPDATE_MS_8L / 8
        for p, (mb, _) in POLICIES.items():
            line = fits[p][0] + LAYERS * fits[p][1]
            copies = fsdp_ms_per_elem * LAYERS * expert_layer / 8 * 2 * (4 // mb) if nodes > 1 else 0.0
            traffic = inter[p] if nodes > 1 else 0.0
            full, exposed = exchange[(8, p)]
            base = line + update + copies + traffic
            steps[(name, p)] = [base + LAYERS * x for x in (exposed, full, full * (1 - OVERLAP_WHAT_IF))]
            print(row(f"{name}, {p}", line, update, copies, traffic, LAYERS * exposed, steps[(name, p)][0]))
    print("   (update: the local experts' AdamW at this layout's size, fused at ep_fsdp 1, less the EP 2 line's share;")
    print(f"    FSDP copies: {fsdp_ms_per_elem * 1e9:.2f} ms per G gathered expert elements, from EP 1 × ep_fsdp 2)\n")

    fpt = flops_per_token(c)
    print(f"4b. Projection, 48 layers ({fpt / 1e9:.2f} GFLOP/token; MFU over {PEAK_FLOPS / 1e12:.0f} TFLOP/s)")
    print(row("layout, policy", "GiB, fits?", "tok/s/GPU", "MFU %", "exch. exposed", f"{OVERLAP_WHAT_IF:.0%} hidden"))
    for (name, p), ms in steps.items():
        toks = [TOKENS / s * 1e3 for s in ms]
        gib = memory[(name, p)]
        fits_mem = f"{gib:.0f} {'yes' if gib <= BUDGET_GIB else 'no'}"
        print(row(f"{name}, {p}", fits_mem, toks[0], 100 * toks[0] * fpt / PEAK_FLOPS, *toks[1:]))
    print(
        "   (tok/s/GPU: the schedule hides what the own copies' GEMM can; exposed: none hidden; GiB: reserved, table 3)"
    )
    nemo_mfu = 100 * NEMO_TOKS * fpt / PEAK_FLOPS
    print(f"   reference: NeMo, 8×H100, {NEMO_TOKS:,} tok/s/GPU ({nemo_mfu:.1f}% of 989 TFLOP/s)")


if __name__ == "__main__":
    main()
