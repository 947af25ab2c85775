"""The split-KV forward of `xattn_core.block_forward`. On CPU the same split-and-merge code runs around the math
path, so forced chunk counts are checked here in float64 against the unsplit block: shard lengths divisible
and not divisible by the count, masks with fully masked rows, logits near 1e4. The fused kernels' split runs
in tests/gpu/test_lv_xattn_cuda.py.
"""

from __future__ import annotations

import pytest
import torch

from src.models import xattn_core
from src.models.xattn_core import auto_kv_chunks, block_forward, chunks_to_fill, visible_keys
from tests.test_lv_xattn import assert_exact, op_cases, reference_op, run_op, tensors

F64 = torch.float64
SCALE = 0.5


def inputs(skv: int, masks: str | None, large_logits: bool) -> tuple[torch.Tensor, ...]:
    """q [2, 4, 5, 8] against skv keys with 2 K/V heads (GQA); K with packed heads in memory, as the layer makes
    it (the chunks are views), V heads-first (they are copies)."""
    gen = torch.Generator().manual_seed(skv)
    batch, heads, kv_heads, sq, dim = 2, 4, 2, 5, 8
    q = torch.randn(batch, heads, sq, dim, generator=gen, dtype=F64)
    k = torch.randn(batch, skv, kv_heads, dim, generator=gen, dtype=F64).transpose(1, 2)
    v = torch.randn(batch, kv_heads, skv, dim, generator=gen, dtype=F64)
    if large_logits:  # every logit of a row near 1e4
        q[..., 0] += 2e4
        k[..., 0] = 1.0
    padding = torch.rand(batch, skv, generator=gen) < 0.3
    padding[1] = True  # batch 1 sees no key at all
    visible = None
    if masks == "padding":
        visible = visible_keys(None, None, padding)
    elif masks == "segments":  # query id 3 has no key
        visible = visible_keys(torch.randint(0, 4, (batch, sq), generator=gen),
                               torch.randint(0, 3, (batch, skv), generator=gen), padding)
    return q, k, v, visible


@pytest.mark.parametrize("large_logits", [False, True], ids=["logits1", "logits1e4"])
@pytest.mark.parametrize("masks", [None, "padding", "segments"])
@pytest.mark.parametrize("skv", [30, 31], ids=["divisible", "remainder"])
@pytest.mark.parametrize("chunks", [2, 3, 5])
def test_split_equals_the_unsplit_block(chunks, skv, masks, large_logits):
    q, k, v, visible = inputs(skv, masks, large_logits)
    out, lse = block_forward(q, k, v, visible, SCALE, kv_chunks=chunks)
    ref_out, ref_lse = block_forward(q, k, v, visible, SCALE, kv_chunks=1)
    assert out.dtype == lse.dtype == F64
    blocked = ref_lse == float("-inf")
    assert blocked.any() == (masks is not None)
    assert torch.equal(lse == float("-inf"), blocked) and out[blocked].eq(0).all()
    # Logits near 1e4 carry an ulp of 1.8e-12 themselves, and the chunks' matmuls may round them differently.
    assert_exact(out, ref_out, "out", tol=1e-11 if large_logits else 1e-12)
    assert_exact(lse.masked_fill(blocked, 0.0), ref_lse.masked_fill(blocked, 0.0), "lse", tol=1e-12)


def test_one_kernel_call_for_all_chunks_and_one_for_the_remainder(monkeypatch):
    calls = []
    kernel = xattn_core._kernel_forward

    def spy(q, k, *rest):
        calls.append((q.shape[0], k.shape[2]))
        return kernel(q, k, *rest)

    monkeypatch.setattr(xattn_core, "_kernel_forward", spy)
    monkeypatch.setattr(xattn_core, "KV_CHUNKS", 3)
    q, k, v, _ = inputs(31, None, False)
    block_forward(q, k, v, None, SCALE)
    assert calls == [(2 * 3, 10), (2, 1)]  # batch 2 x 3 chunks of 10 keys, then the 31st key
    calls.clear()
    block_forward(q, k, v, None, SCALE, kv_chunks=1)  # the argument overrides the module setting
    assert calls == [(2, 31)]


def test_chunk_count_below_one_is_an_error():
    q, k, v, _ = inputs(30, None, False)
    with pytest.raises(ValueError, match="kv_chunks=0"):
        block_forward(q, k, v, None, SCALE, kv_chunks=0)


def test_automatic_split_is_off_on_the_math_path():
    for dtype in (torch.bfloat16, F64):
        q = torch.zeros(1, 16, 512, 128, dtype=dtype)
        k = torch.zeros((), dtype=dtype).expand(1, 16, 131072, 128)  # the GPU test's shapes, without the memory
        assert auto_kv_chunks(q, k, k, None) == 1


@pytest.mark.parametrize(("sq", "chunks"), [(512, 4), (1024, 2), (2048, 1), (4096, 1)])
def test_heuristic_on_an_h200(sq, chunks):
    """B = 1, H = 16, FlashAttention-2's 128-row tiles, 132 SMs with two resident blocks each."""
    blocks = 16 * -(-sq // 128)
    assert [chunks_to_fill(blocks, 2 * 132, keys) for keys in (2**15, 2**17, 2**19)] == [chunks] * 3


def test_heuristic_keeps_chunks_of_at_least_4096_keys():
    assert chunks_to_fill(64, 264, 8191) == 1
    assert chunks_to_fill(64, 264, 8192) == 2


@pytest.mark.parametrize("case", op_cases(1), ids=lambda c: c.id)
def test_ops_with_a_forced_split_match_the_reference(case, monkeypatch):
    """LV-XAttn and Ring on one process with every block split in 2 (one key left over on odd shards)."""
    monkeypatch.setattr(xattn_core, "KV_CHUNKS", 2)
    t = tensors(case)
    got = run_op(case, {n: x.clone() for n, x in t.items()})
    expected = reference_op(case, t)
    for name in ("out", "dq", "dk", "dv"):
        assert_exact(got[name], expected[name], name)
