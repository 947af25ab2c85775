"""One cross-attention layer, forward + backward, with LV-XAttn, Ring-Attention and local compute only, on 2 GPUs.

    torchrun --nproc_per_node=2 bench/lv_xattn.py --out lv_nvlink.json                  # NVLink, as it comes
    NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo \\
        torchrun --nproc_per_node=2 bench/lv_xattn.py --out lv_socket.json              # cluster-like link
    python -m torch.distributed.run --standalone --nproc_per_node=2 bench/lv_xattn.py --quick --out x.json  # CPU

(add PYTHONPATH=. where the project is not pip-installed). bf16, B = 1, H = 16, D = 128 (width 2048 for text
and visual features), S_Q in {1K, 4K}, S_KV in {64K, 256K, 1M} in total, split evenly over the ranks. The
layer is `CrossAttentionBlock` with recomputation on:
- local:     no communication: every rank attends all S_Q queries to its own visual shard (same FLOPs per rank);
- lv_xattn:  LV-XAttn ring, queries sharded (S_Q/P per rank);
- lv_gather: LV-XAttn gather schedule, queries sharded: all-gathered, one kernel call per pass, reduce-scattered;
- lv_allred: LV-XAttn with the queries on every rank, merged with all-reduces;
- ring:      Ring-Attention, queries sharded, K/V rotating.
The link mode is read from the NCCL variables the caller sets. The same run measures the link's bandwidth (a
bidirectional send/recv), times the local attention kernels, and prints next to each measurement the time the
communication formula predicts (docs/lv_xattn.md), and where the formula says LV-XAttn's transfers hide
(steady state) and where it puts the ring within 10% of local (the exposed last hop included; per S_Q;
`--sq`/`--skv` pick other sizes). The distributed layers get every rank's shard lengths
once per config (`shard_lengths`), as a model passes them to all its layers; `--lengths exchanged given` also
measures them exchanging shapes in every call (a host synchronisation per call), each row's `lengths` says
which. Times are CUDA-event medians, the slowest rank's; a config whose estimated memory does not fit is
skipped and listed. Prints a markdown table; --out writes JSON. `--profile DIR` also runs each layer a few
times under torch.profiler and prints where its GPU time goes and how long the GPU sat idle (rank 0's
Chrome traces go to DIR).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from src.models.cross_attention import CrossAttentionBlock, saved_activation_bytes
from src.parallel.xattn import lv as lv_module
from src.parallel.xattn import ring as ring_module
from src.parallel.xattn.comm import shard_lengths
from src.parallel.xattn.core import block_backward, block_forward

IMPLS = {  # name -> (block impl, q_sharded, byte counter)
    "local": ("local", False, None),
    "lv_xattn": ("lv_xattn", True, lv_module.BYTES_SENT),
    "lv_gather": ("lv_xattn_gather", True, lv_module.BYTES_SENT),
    "lv_allred": ("lv_xattn", False, lv_module.BYTES_SENT),
    "ring": ("ring", True, ring_module.BYTES_SENT),
}
GiB = 2**30


def link_mode(device: torch.device) -> str:
    if device.type == "cpu":
        return "gloo (CPU smoke run)"
    forced = [v for v in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE") if os.environ.get(v) == "1"]
    if len(forced) == 3:
        return f"cluster-like: NCCL sockets over {os.environ.get('NCCL_SOCKET_IFNAME', '?')}"
    return "nvlink (as the machine comes)" if not forced else f"partial: {', '.join(forced)}"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(fn, device: torch.device) -> float:
    """Milliseconds of one call, started on all ranks together."""
    dist.barrier()
    synchronize(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    began = time.perf_counter()
    fn()
    return (time.perf_counter() - began) * 1e3


def time_ms(fn, device: torch.device, budget_s: float) -> float:
    """The slowest rank's median over 2 to 10 calls (as many as fit in the budget, the same on every rank).
    Call fn once before, as a warm-up."""
    first = torch.tensor([time_once(fn, device)], device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MAX)
    more = max(1, min(9, int(budget_s * 1e3 / max(first.item(), 1e-3)) - 1))
    median = torch.tensor([statistics.median([first.item(), *(time_once(fn, device) for _ in range(more))])],
                          device=device)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return median.item()


def bandwidth_gbps(device: torch.device, nbytes: int, budget_s: float) -> float:
    """Bytes per second per direction while every rank sends to the next and receives from the previous, as in
    the ring."""
    rank, world = dist.get_rank(), dist.get_world_size()
    send = torch.ones(nbytes, dtype=torch.uint8, device=device)
    receive = torch.empty_like(send)

    def exchange():
        ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, receive, (rank - 1) % world)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    exchange()  # warm-up
    ms = time_ms(exchange, device, budget_s)
    return nbytes / ms / 1e6


def ring_ms(compute_ms: float, message: int, accumulator: int, world: int, bw: float) -> float:
    """The ring pass of src.parallel.xattn.comm: step t computes 1/P of the work while the next message (steps
    t < P-1) and the previous accumulator (steps t >= 2) are in flight; the last accumulator hop is exposed."""
    step = compute_ms / world
    transfer = lambda t: ((message if t < world - 1 else 0) + (accumulator if t >= 2 else 0)) / bw / 1e6
    return sum(max(step, transfer(t)) for t in range(world)) + accumulator / bw / 1e6


def predict_ms(impl: str, local_ms: float, attn_ms: tuple[float, float], sq: int, skv_local: int, heads: int,
               dim: int, world: int, bw: float) -> float:
    """The layer's time from the local-only measurement, with the attention replaced by its communication
    schedule at bandwidth `bw` (GB/s). bf16 tensors are 2 bytes, accumulators (O, LSE, dQ, dK, dV) 4."""
    fwd, bwd = attn_ms
    rows = sq // world * heads  # one query block, all heads
    if impl == "local":
        return local_ms
    if impl == "lv_allred":  # not overlapped: all-reduce of LSE, then of O·w and w (fwd), of dQ (bwd)
        volume = 2 * (world - 1) / world * sq * heads * 4 * ((1 + dim + 1) + dim)
        return local_ms + volume / bw / 1e6
    if impl == "lv_gather":  # the local kernels on all queries; nothing overlapped
        forward = rows * (world - 1) * (dim * 2 + (dim + 1) * 4) + 2 * (world - 1) / world * sq * heads * 4
        backward = rows * (world - 1) * (3 * dim * 2 + 4 + dim * 4)  # gathers of Q, dO, O, L; scatter of dQ
        return local_ms + (forward + backward) / bw / 1e6
    if impl == "lv_xattn":
        phases = [(fwd, rows * dim * 2, rows * (dim + 1) * 4), (bwd, rows * (3 * dim * 2 + 4), rows * dim * 4)]
    else:  # ring: K and V out; dK and dV accumulators travel in backward
        kv = 2 * skv_local * heads * dim
        phases = [(fwd, kv * 2, 0), (bwd, kv * 2, kv * 4)]
    return local_ms - fwd - bwd + sum(ring_ms(t, m, a, world, bw) for t, m, a in phases)


def attention_ms(sq: int, skv_local: int, heads: int, dim: int, dtype, device, budget_s: float):
    """The local kernel alone on this rank's shard: forward and backward milliseconds."""
    q = torch.randn(1, heads, sq, dim, dtype=dtype, device=device)
    k, v = (torch.randn(1, heads, skv_local, dim, dtype=dtype, device=device) for _ in range(2))
    scale = dim ** -0.5
    out, lse = block_forward(q, k, v, None, scale)  # also the warm-up
    out = out.to(dtype)
    block_backward(q, k, v, None, scale, out, out, lse)
    fwd = time_ms(lambda: block_forward(q, k, v, None, scale), device, budget_s)
    bwd = time_ms(lambda: block_backward(q, k, v, None, scale, out, out, lse), device, budget_s)
    return fwd, bwd


def profile(fn, label: str, device: torch.device, folder: str, steps: int = 3) -> None:
    """Run fn `steps` times under torch.profiler and print, per step: the GPU's busy time (the union of all
    kernel intervals, every stream), its idle time inside the span from the first kernel to the last, the
    kernel count, and the kernels that take the most time. Rank 0 prints and writes its Chrome trace."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    dist.barrier()
    synchronize(device)
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        synchronize(device)
    if dist.get_rank() != 0:
        return
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, reach, totals = 0.0, float("-inf"), {}
    for start, end, name in kernels:
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
        totals[name] = totals.get(name, 0.0) + end - start
    span = kernels[-1][1] - kernels[0][0] if kernels else 0.0
    top = sorted(totals.items(), key=lambda item: -item[1])[:6]
    print(f"### profile {label}: per step GPU busy {busy / steps / 1e3:.2f} ms, idle {(span - busy) / steps / 1e3:.2f} "
          f"ms, {len(kernels) // steps} kernels", flush=True)
    for name, total in top:
        print(f"    {total / steps / 1e3:7.3f} ms  {name[:110]}", flush=True)
    os.makedirs(folder, exist_ok=True)
    prof.export_chrome_trace(os.path.join(folder, label.replace(" ", "_").replace("=", "") + ".json"))


def fits(skv_local: int, width: int, device: torch.device) -> bool:
    """Generous estimate: visual shard, its gradient, norm output, K, V, two K/V receive buffers and fp32 dK/dV
    accumulators in flight: about 20 bf16 copies of the shard. Decided on the fullest rank."""
    if device.type != "cuda":
        return True
    free = torch.tensor([torch.cuda.mem_get_info(device)[0]], device=device, dtype=torch.float64)
    dist.all_reduce(free, op=dist.ReduceOp.MIN)
    return 20 * skv_local * width * 2 < 0.9 * free.item()


def run_config(args, sq: int, skv: int, device: torch.device, dtype, bw: float) -> tuple[list[dict], dict]:
    world, rank = dist.get_world_size(), dist.get_rank()
    heads, dim = args.heads, args.head_dim
    width, skv_local = heads * dim, skv // world
    gen = torch.Generator(device=device).manual_seed(rank)
    visual = torch.randn(1, skv_local, width, dtype=dtype, device=device, generator=gen).requires_grad_()
    text_all = torch.randn(1, sq, width, dtype=dtype, device=device, generator=gen)
    torch.manual_seed(0)
    block = CrossAttentionBlock(width, heads, ls_init_value=0.1, recompute=True).to(device, dtype)
    rows = []
    attn = attention_ms(sq, skv_local, heads, dim, dtype, device, args.budget)
    for setting in args.lengths:
        local_ms = None
        for name, (impl, q_sharded, counter) in IMPLS.items():
            block.impl = impl
            text = text_all.chunk(world, dim=1)[rank] if q_sharded else text_all
            text = text.detach().requires_grad_()
            grad = torch.ones_like(text)
            lengths = None
            if setting == "given" and name != "local":
                lengths = shard_lengths(text.shape[1], skv_local, device)

            def step(text=text, q_sharded=q_sharded, grad=grad, lengths=lengths):
                block(text, visual, q_sharded=q_sharded, lengths=lengths).backward(grad)

            if counter is not None:
                counter.reset()
            step()  # warm-up, and the bytes of one call
            sent = (counter.forward, counter.backward) if counter is not None else (0, 0)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            ms = time_ms(step, device, args.budget)
            local_ms = ms if name == "local" else local_ms
            predicted = predict_ms(name, local_ms, attn, sq, skv_local, heads, dim, world, bw)
            if args.profile:
                profile(step, f"S_Q={sq} S_KV={skv} lengths={setting} {name}", device, args.profile)
            rows.append(dict(S_Q=sq, S_KV=skv, S_KV_per_rank=skv_local, lengths=setting, impl=name, ms=ms,
                             predicted_ms=predicted, bytes_forward=sent[0], bytes_backward=sent[1],
                             attention_fwd_ms=attn[0], attention_bwd_ms=attn[1],
                             peak_GiB=torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else None))
    memory = dict(S_Q=sq, S_KV=skv)
    block.impl = "lv_xattn"
    text = text_all.chunk(world, dim=1)[rank].detach().requires_grad_()
    for recompute in (True, False):
        block.recompute = recompute
        _, saved = saved_activation_bytes(lambda: block(text, visual, q_sharded=True), exclude=block.parameters())
        memory[f"saved_MiB_recompute_{'on' if recompute else 'off'}"] = saved / 2**20
    return rows, memory


def hide_threshold(row: dict, heads: int, dim: int, world: int, bw: float) -> float:
    """S_KV/P from which every LV-XAttn step's compute covers the transfers in flight during it, in both
    passes, from a local-only row's kernel times (compute grows linearly with S_KV/P; the bytes don't).
    In flight per query row and head: forward Q (bf16); backward Q, dO, O (bf16) and LSE (fp32); from P = 3
    on also the accumulators O+LSE / dQ (fp32)."""
    more = world > 2
    in_flight = {"attention_fwd_ms": dim * 2 + more * (dim + 1) * 4,
                 "attention_bwd_ms": 3 * dim * 2 + 4 + more * dim * 4}
    rows_seconds = row["S_Q"] * heads / (bw * 1e9)  # seconds to move one byte for every query row and head
    return max(row["S_KV_per_rank"] * rows_seconds * b / (row[k] / 1e3) for k, b in in_flight.items())


def within_threshold(row: dict, heads: int, dim: int, world: int, bw: float, margin: float = 0.10) -> int:
    """The smallest S_KV/P at which the communication formula (`predict_ms`, the exposed last accumulator hop
    included) puts the LV-XAttn ring within `margin` of local compute, at this row's S_Q. The local times
    are this local-only row's, scaled linearly in S_KV/P. With P = 2 nothing overlaps the last hop, so this
    lies above `hide_threshold`."""
    def ratio(skv_local: int) -> float:
        f = skv_local / row["S_KV_per_rank"]
        local, attn = row["ms"] * f, (row["attention_fwd_ms"] * f, row["attention_bwd_ms"] * f)
        return predict_ms("lv_xattn", local, attn, row["S_Q"], skv_local, heads, dim, world, bw) / local

    low, high = 1, max(2, row["S_KV_per_rank"])
    while ratio(high) > 1 + margin:
        low, high = high, high * 2
    while high - low > 1:  # the ratio falls as S_KV/P grows: the bytes stay, the compute grows
        middle = (low + high) // 2
        low, high = (low, middle) if ratio(middle) <= 1 + margin else (middle, high)
    return high


def _cell(row: dict) -> str:
    return f"{row['ms']:.2f} ({row['predicted_ms']:.2f})"


def table(rows: list[dict], memory: list[dict]) -> str:
    lines = ["| S_Q | S_KV | S_KV/P | lengths | local ms | LV-XAttn ms (pred.) | LV gather ms (pred.) "
             "| LV all-reduce ms (pred.) | Ring ms (pred.) | LV / local | LV gather / local | Ring / LV "
             "| saved act. MiB, recompute on / off |", "|" + " --- |" * 13]
    for mem in memory:
        for setting in dict.fromkeys(r["lengths"] for r in rows):
            by = {r["impl"]: r for r in rows
                  if (r["S_Q"], r["S_KV"], r["lengths"]) == (mem["S_Q"], mem["S_KV"], setting)}
            lines.append(
                f"| {mem['S_Q']} | {mem['S_KV']} | {by['local']['S_KV_per_rank']} | {setting} "
                f"| {by['local']['ms']:.2f} | {_cell(by['lv_xattn'])} | {_cell(by['lv_gather'])} "
                f"| {_cell(by['lv_allred'])} | {_cell(by['ring'])} | {by['lv_xattn']['ms'] / by['local']['ms']:.3f} "
                f"| {by['lv_gather']['ms'] / by['local']['ms']:.3f} | {by['ring']['ms'] / by['lv_xattn']['ms']:.2f} "
                f"| {mem['saved_MiB_recompute_on']:.4g} / {mem['saved_MiB_recompute_off']:.4g} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: gloo, tiny sizes")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--budget", type=float, default=1.5, help="seconds of timed calls per measurement")
    parser.add_argument("--lengths", nargs="+", choices=["given", "exchanged"], default=["given"],
                        help="shard lengths passed to the layers once per config (given) and/or exchanged by "
                             "every call (exchanged: a host synchronisation per call)")
    parser.add_argument("--sq", nargs="+", type=int, help="query lengths S_Q (default: 1024 4096)")
    parser.add_argument("--skv", nargs="+", type=int, help="total key lengths S_KV (default: 65536 262144 1048576)")
    parser.add_argument("--profile", metavar="DIR", help="also profile every layer; rank 0's traces go to DIR")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        print("run under torchrun, e.g. torchrun --nproc_per_node=2 bench/lv_xattn.py", file=sys.stderr)
        return 2
    if args.quick and args.profile:
        print("--profile needs CUDA GPUs: it reports the kernel timeline", file=sys.stderr)
        return 2
    if args.quick:
        device, sq_list, skv_list = torch.device("cpu"), [16], [64, 256]
        args.heads, args.head_dim, args.budget, link_bytes = 2, 16, 0.05, 2**20
        dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    else:
        if not torch.cuda.is_available():
            print("bench/lv_xattn.py needs CUDA GPUs (or --quick for the CPU smoke run)", file=sys.stderr)
            return 2
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        sq_list, skv_list = args.sq or [1024, 4096], args.skv or [65536, 262144, 1048576]
        args.heads, args.head_dim, link_bytes = 16, 128, 256 * 2**20
        dist.init_process_group("nccl", device_id=device, timeout=timedelta(minutes=10))
    world, rank, dtype = dist.get_world_size(), dist.get_rank(), torch.bfloat16
    mode = link_mode(device)
    bw = bandwidth_gbps(device, link_bytes, args.budget)
    if rank == 0:
        print(f"# {mode}: {world} ranks, measured {bw:.1f} GB/s per direction", flush=True)
    rows, memory, skipped = [], [], []
    for sq in sq_list:
        for skv in skv_list:
            if not fits(skv // world, args.heads * args.head_dim, device):
                skipped.append(dict(S_Q=sq, S_KV=skv, reason="estimated memory does not fit"))
                continue
            config_rows, config_memory = run_config(args, sq, skv, device, dtype, bw)
            rows += config_rows
            memory.append(config_memory)
            if rank == 0:
                for row in config_rows:
                    print(json.dumps(row), flush=True)
    if rank == 0:
        largest = max((r for r in rows if r["impl"] == "local"), key=lambda r: (r["S_KV"], r["S_Q"]))
        threshold = hide_threshold(largest, args.heads, args.head_dim, world, bw)
        within = {sq: within_threshold(max((r for r in rows if r["impl"] == "local" and r["S_Q"] == sq),
                                           key=lambda r: r["S_KV"]), args.heads, args.head_dim, world, bw)
                  for sq in dict.fromkeys(r["S_Q"] for r in rows)}
        print(f"\n## {mode}, {bw:.1f} GB/s: LV-XAttn's transfers hide once S_KV/P >= {threshold:,.0f}; the "
              "formula puts it within 10% of local from S_KV/P >= "
              + ", ".join(f"{n:,} (S_Q = {sq})" for sq, n in within.items()) + "\n")
        print(table(rows, memory))
        for skip in skipped:
            print(f"skipped S_Q={skip['S_Q']} S_KV={skip['S_KV']}: {skip['reason']}")
        result = dict(mode=mode, world=world, bandwidth_GBps=bw, hide_threshold_S_KV_per_rank=threshold,
                      within_10pct_S_KV_per_rank={str(sq): n for sq, n in within.items()},
                      heads=args.heads, head_dim=args.head_dim, dtype=str(dtype), torch=torch.__version__,
                      device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                      date=time.strftime("%Y-%m-%d"), command=" ".join(sys.argv), rows=rows, memory=memory,
                      skipped=skipped)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
