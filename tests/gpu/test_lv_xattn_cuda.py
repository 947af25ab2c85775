"""The CUDA path of LV-XAttn and the Ring baseline: the fused local kernels (FlashAttention without a mask,
the memory-efficient kernel with one) against the fp32 math path, and the ops (every entry of `OPS`: LV-XAttn's
ring and gather schedules, Ring) in bf16 on one GPU and over NCCL on two against the float64 reference of the
same bf16 inputs.

Run on a GPU machine: python -m pytest tests/gpu/test_lv_xattn_cuda.py
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from src.parallel.xattn.core import block_backward, block_forward, visible_keys
from tests.test_lv_xattn import Case, assert_exact, check_ranks, local_part, op_cases, reference_op, run_op, tensors

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BF16 = torch.bfloat16


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert_exact(actual, expected, what, tol=2e-2)  # bf16 outputs and gradients


@pytest.mark.parametrize("masked", [False, True], ids=["flash", "efficient+mask"])
@pytest.mark.parametrize("dim", [64, 128])
def test_fused_kernels_match_the_math_path(masked, dim):
    gen = torch.Generator(device="cuda").manual_seed(0)
    batch, heads, kv_heads, sq, skv = 2, 8, 2, 77, 300
    q = torch.randn(batch, heads, sq, dim, device="cuda", generator=gen).to(BF16)
    k, v = (torch.randn(batch, kv_heads, skv, dim, device="cuda", generator=gen).to(BF16) for _ in range(2))
    dout = torch.randn(batch, heads, sq, dim, device="cuda", generator=gen).to(BF16)
    visible = None
    if masked:
        q_ids = torch.randint(0, 4, (batch, sq), device="cuda", generator=gen)
        kv_ids = torch.randint(0, 3, (batch, skv), device="cuda", generator=gen)  # id 3: rows with no key
        visible = visible_keys(q_ids, kv_ids, torch.rand(batch, skv, device="cuda", generator=gen) < 0.3)
    scale = dim ** -0.5
    out, lse = block_forward(q, k, v, visible, scale)
    ref_out, ref_lse = block_forward(q.float(), k.float(), v.float(), visible, scale)  # math path
    close(out, ref_out, "out")
    assert torch.equal(lse.isinf(), ref_lse.isinf())
    close(lse.masked_fill(lse.isinf(), 0), ref_lse.masked_fill(ref_lse.isinf(), 0), "lse")
    grads = block_backward(q, k, v, visible, scale, dout, out.to(BF16), lse)
    ref_grads = block_backward(q.float(), k.float(), v.float(), visible, scale, dout.float(), ref_out, ref_lse)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        close(got, want, name)


def bf16_inputs(case: Case) -> dict[str, torch.Tensor]:
    """The case's inputs rounded to bf16 (kept in float64 for the reference)."""
    return {n: x.to(BF16).double() if x.is_floating_point() else x for n, x in tensors(case).items()}


def on_gpu(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: x.to("cuda", BF16 if x.is_floating_point() else x.dtype) for n, x in t.items()}


def check(case: Case, ranks: list[dict]) -> None:
    expected = reference_op(case, bf16_inputs(case))
    check_ranks(case, ranks, expected, ["out", "dq"], ["dk", "dv"], dim=2, compare=close)


@pytest.mark.parametrize("case", op_cases(1), ids=lambda c: c.id)
def test_single_gpu_bf16(case):
    got = run_op(case, on_gpu(bf16_inputs(case)))
    check(case, [got])


def nccl_worker(rank: int, world: int, folder: str) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{folder}/store", rank=rank, world_size=world,
                            device_id=device, timeout=timedelta(seconds=120))
    results = {}
    for case in op_cases(world):
        got = run_op(case, on_gpu(local_part(case, bf16_inputs(case), rank)))
        results[case.id] = {n: x.cpu() if isinstance(x, torch.Tensor) else x for n, x in got.items()}
    torch.save(results, f"{folder}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_bf16_over_nccl(tmp_path):
    mp.spawn(nccl_worker, args=(2, str(tmp_path)), nprocs=2)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for case in op_cases(2):
        check(case, [r[case.id] for r in results])
