"""LV-XAttn, the Ring baseline and the cross-attention block against the single-process reference.

Every distributed case runs in one gloo group per world size (2 and 3 processes, float64, spawned once per
module), which saves its outputs, gradients and byte counts; the tests then compare each case with the
reference here, to 1e-10 relative to the largest reference value (or 1e-10 absolute below 1).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace
from datetime import timedelta
from functools import partial

import pytest
import torch
import torch.distributed as dist

from src.models.cross_attention import CrossAttentionBlock, saved_activation_bytes
from src.parallel.xattn import lv as lv_module
from src.parallel.xattn import ring as ring_module
from src.parallel.xattn.comm import ShardLengths, shard_lengths
from src.parallel.xattn.core import cross_attention_reference, merge_partials, visible_keys
from tests.conftest import fork_ranks

# Keyed by the layer's impl names, so that every op case and layer case runs for each.
OPS = {
    "lv_xattn": (lv_module.lv_xattn, lv_module.BYTES_SENT),
    "lv_xattn_gather": (partial(lv_module.lv_xattn, schedule="gather"), lv_module.BYTES_SENT),
    "ring": (ring_module.ring_xattn, ring_module.BYTES_SENT),
}
F64 = torch.float64
TOL = 1e-10


@dataclass(frozen=True)
class Case:
    name: str
    impl: str  # a key of OPS
    q_sharded: bool
    q_lens: tuple[int, ...]  # queries per rank (all equal when q_sharded=False)
    kv_lens: tuple[int, ...]
    heads: int = 4
    kv_heads: int = 2
    masks: bool = False  # key padding (all of batch 1, some of batch 0) + segment ids with unseen ids
    scale: float | None = None
    large_logits: bool = False  # every logit of a row offset by ~1e4: a naive exp overflows, softmax is fine
    layer: bool = False
    recompute: bool = False

    @property
    def id(self) -> str:
        mode = "qshard" if self.q_sharded else "qrep"
        layer = f"-layer-recompute{int(self.recompute)}" if self.layer else ""
        return f"{self.impl}-{mode}-{self.name}{layer}"


def op_cases(world: int) -> list[Case]:
    uneven_q, uneven_kv = {1: ((3,), (5,)), 2: ((0, 4), (6, 0)), 3: ((3, 0, 2), (5, 0, 3))}[world]
    even_q, even_kv = (3,) * world, (4,) * world
    scenarios = [
        ("even", even_q, even_kv, {}),
        ("uneven_empty", uneven_q, uneven_kv, {}),
        ("masked", uneven_q, uneven_kv, dict(masks=True)),
        ("large_logits", even_q, uneven_kv, dict(scale=0.5, large_logits=True)),
        ("mha", even_q, even_kv, dict(kv_heads=4)),
    ]
    return [
        Case(name, impl, q_sharded, q_lens if q_sharded else (5,) * world, kv_lens, **extra)
        for name, q_lens, kv_lens, extra in scenarios for impl in OPS for q_sharded in (True, False)]


def layer_cases(world: int) -> list[Case]:
    q_lens, kv_lens = ((2, 4), (5, 3)) if world == 2 else ((3, 0, 2), (4, 0, 6))
    return [
        Case("block", impl, q_sharded, q_lens if q_sharded else (5,) * world, kv_lens, masks=True, layer=True,
             recompute=recompute)
        for impl in OPS for q_sharded in (True, False) for recompute in (True, False)]


def tensors(case: Case) -> dict[str, torch.Tensor]:
    """The global inputs of a case, the same in every process."""
    gen = torch.Generator().manual_seed(zlib.crc32(case.id.encode()))
    batch, dim = 2, 8
    sq = sum(case.q_lens) if case.q_sharded else case.q_lens[0]
    skv = sum(case.kv_lens)
    if case.layer:
        shapes = dict(q=(batch, sq, 16), k=(batch, skv, 12), g=(batch, sq, 16))
    else:
        kv = (batch, case.kv_heads, skv, dim)
        shapes = dict(q=(batch, case.heads, sq, dim), k=kv, v=kv, g=(batch, case.heads, sq, dim))
    out = {name: torch.randn(shape, generator=gen, dtype=F64) for name, shape in shapes.items()}
    if case.large_logits:
        out["q"][..., 0] += 2e4
        out["k"][..., 0] = 1.0
    if case.masks:
        padding = torch.rand(batch, skv, generator=gen) < 0.3
        padding[1] = True  # batch 1 sees no key at all
        out.update(padding=padding, q_ids=torch.randint(0, 4, (batch, sq), generator=gen),
                   kv_ids=torch.randint(0, 3, (batch, skv), generator=gen))  # query id 3 has no key
    return out


def narrow(x: torch.Tensor, lens: tuple[int, ...], rank: int, dim: int) -> torch.Tensor:
    return x.narrow(dim, sum(lens[:rank]), lens[rank]).clone()


def local_part(case: Case, t: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """This rank's slice: keys/values and their masks always, queries (their ids, g) only when q_sharded."""
    seq = 1 if case.layer else 2  # sequence dim of q, k, v, g; ids and padding are [B, S]
    out = {}
    for name, x in t.items():
        dim = 1 if name in ("padding", "q_ids", "kv_ids") else seq
        if name in ("k", "v", "padding", "kv_ids"):
            out[name] = narrow(x, case.kv_lens, rank, dim)
        else:
            out[name] = narrow(x, case.q_lens, rank, dim) if case.q_sharded else x.clone()
    return out


def mask_args(t: dict[str, torch.Tensor]) -> dict:
    return dict(key_padding_mask=t.get("padding"), q_segment_ids=t.get("q_ids"), kv_segment_ids=t.get("kv_ids"))


def make_block(case: Case) -> CrossAttentionBlock:
    torch.manual_seed(zlib.crc32(case.id.encode()))
    return CrossAttentionBlock(16, 4, kv_width=12, kv_heads=2, ls_init_value=0.5, recompute=case.recompute,
                               impl=case.impl).double()


def run_op(case: Case, t: dict[str, torch.Tensor], group=None, lengths: ShardLengths | None = None) -> dict:
    fn, counter = OPS[case.impl]
    q, k, v = (t[n].requires_grad_() for n in "qkv")
    counter.reset()
    out = fn(q, k, v, group, q_sharded=case.q_sharded, scale=case.scale, lengths=lengths, **mask_args(t))
    forward = counter.forward
    (out * t["g"]).sum().backward()
    return dict(out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad, forward=forward, backward=counter.backward)


def run_layer(case: Case, t: dict[str, torch.Tensor]) -> dict:
    block = make_block(case)
    text, visual = t["q"].requires_grad_(), t["k"].requires_grad_()
    y, saved = saved_activation_bytes(
        lambda: block(text, visual, q_sharded=case.q_sharded, **mask_args(t)), exclude=block.parameters())
    (y * t["g"]).sum().backward()
    grads = {name: p.grad for name, p in block.named_parameters()}
    return dict(out=y.detach(), dtext=text.grad, dvisual=visual.grad, saved=saved, grads=grads)


def strided(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same values as views that are not contiguous (every other element of a tensor twice as long in its
    last dim), as a caller's slices of a larger batch are."""
    return {name: torch.stack([x, torch.zeros_like(x)], dim=-1)[..., 0] for name, x in t.items()}


def strided_cases(world: int) -> list[Case]:
    return [c for c in op_cases(world) if c.name == "masked"] + [c for c in layer_cases(world) if not c.recompute]


def worker(rank: int, world: int, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    results = {case.id: run_op(case, local_part(case, tensors(case), rank)) for case in op_cases(world)}
    results.update({case.id: run_layer(case, local_part(case, tensors(case), rank)) for case in layer_cases(world)})
    for case in op_cases(world):  # the same calls with the lengths exchanged beforehand, once per case
        if case.name in ("uneven_empty", "masked"):
            local = local_part(case, tensors(case), rank)
            lengths = shard_lengths(local["q"].shape[2], local["k"].shape[2], local["q"].device)
            results[f"{case.id}-lengths"] = run_op(case, local, lengths=lengths)
    for case in strided_cases(world):  # q, k, v, masks and ids as views: gloo refuses to send such tensors
        local = strided(local_part(case, tensors(case), rank))
        results[f"{case.id}-contiguous"] = {name: x.is_contiguous() for name, x in local.items() if x.numel() > 1}
        results[f"{case.id}-strided"] = (run_layer if case.layer else run_op)(case, local)
    try:  # lengths that disagree with this rank's tensors
        lv_module.lv_xattn(torch.zeros(1, 1, 3, 8), torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 2, 8),
                           lengths=ShardLengths((4,) * world, (2,) * world))
    except ValueError as error:
        results["lengths_error"] = str(error)
    try:  # replicated queries of different lengths must fail on every rank, not hang
        lv_module.lv_xattn(torch.zeros(1, 1, 3 + rank, 8), torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 2, 8),
                           q_sharded=False)
    except ValueError as error:
        results["mismatch_error"] = str(error)
    torch.save(results, f"{folder}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 3], ids=["P2", "P3"])
def distributed(request, tmp_path_factory) -> tuple[int, list[dict]]:
    world = request.param
    folder = tmp_path_factory.mktemp(f"lv_xattn_p{world}")
    fork_ranks(worker, world, str(folder), world=world)
    return world, [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(world)]


def assert_exact(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: float = TOL) -> None:
    """Max error within tol x the largest reference value (tol absolute below 1), and no NaN."""
    actual, expected = actual.double().cpu(), expected.double().cpu()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert not actual.isnan().any(), f"{what}: NaN"
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    error = (actual - expected).abs().max().item() if expected.numel() else 0.0
    assert error <= tol * scale, f"{what}: max error {error:.3g} > {tol:g} x {scale:.3g}"


def reference_op(case: Case, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    q, k, v = (t[n].clone().requires_grad_() for n in "qkv")
    out = cross_attention_reference(q, k, v, scale=case.scale, **mask_args(t))
    dq, dk, dv = torch.autograd.grad((out * t["g"]).sum(), (q, k, v))
    return dict(out=out.detach(), dq=dq, dk=dk, dv=dv)


def check_ranks(case: Case, ranks: list[dict], expected: dict[str, torch.Tensor], q_side: list[str],
                kv_side: list[str], dim: int, compare=assert_exact) -> None:
    """Query-side results are each rank's slice (q_sharded) or the whole; key-side ones its slice."""
    for rank, got in enumerate(ranks):
        for name in q_side:
            want = narrow(expected[name], case.q_lens, rank, dim) if case.q_sharded else expected[name]
            compare(got[name], want, f"rank {rank} {name}")
        for name in kv_side:
            compare(got[name], narrow(expected[name], case.kv_lens, rank, dim), f"rank {rank} {name}")


def expected_bytes(case: Case, rank: int, world: int) -> tuple[int, int]:
    """Analytic bytes sent by `rank` (forward, backward) in float64 (inputs and accumulators 8 bytes)."""
    b, h, hkv, d, size = 2, case.heads, case.kv_heads, 8, 8
    ids = 8 if case.masks else 0  # int64 segment ids travel with Q (LV) or with K/V (Ring), padding (1 B) too
    others = [j for j in range(world) if j != rank]  # accumulators of every other rank's block come through
    forwarded = [j for j in range(world) if j != (rank + 1) % world]  # messages this rank passes on
    nominal = lambda n: 2 * (world - 1) * n // world  # ring all-reduce
    if case.impl.startswith("lv_xattn") and not case.q_sharded:  # both schedules: the all-reduce merge
        rows = b * h * case.q_lens[0] * size
        return nominal(rows) + nominal(rows * (d + 1)), nominal(rows * d)
    if case.impl == "lv_xattn_gather":  # ring all-gather / reduce-scatter of blocks padded to the longest shard
        block, seg = b * h * max(case.q_lens), b * max(case.q_lens) * ids
        lse_max = nominal(b * h * sum(case.q_lens) * size)  # all-reduce over every global row
        forward = (world - 1) * (block * d * size + seg + block * (d + 1) * size) + lse_max  # Q (+ ids), [O·w, w]
        return forward, (world - 1) * (block * (3 * d + 1) * size + seg + block * d * size)  # Q, dO, O, L (+ ids), dQ
    if case.impl == "lv_xattn":
        rows = [b * h * case.q_lens[j] for j in range(world)]
        seg = [b * case.q_lens[j] * ids for j in range(world)]
        q_out = sum(rows[j] * d * size + seg[j] for j in forwarded)  # Q (+ ids)
        o_lse_in = sum(rows[j] * (d + 1) * size for j in others)
        q_do_o_lse_out = sum(rows[j] * (3 * d + 1) * size + seg[j] for j in forwarded)
        dq_in = sum(rows[j] * d * size for j in others)
        return q_out + o_lse_in, q_do_o_lse_out + dq_in
    kv = [2 * b * hkv * case.kv_lens[j] * d * size + b * case.kv_lens[j] * (ids + (1 if case.masks else 0))
          for j in range(world)]
    dkv = sum(2 * b * hkv * case.kv_lens[j] * d * size for j in others) if case.q_sharded else 0
    return sum(kv[j] for j in forwarded), sum(kv[j] for j in forwarded) + dkv


@pytest.mark.parametrize("index", range(len(op_cases(2))), ids=[c.id for c in op_cases(2)])
def test_op_matches_reference(distributed, index):
    world, results = distributed
    case = op_cases(world)[index]
    assert case.id == op_cases(2)[index].id
    t = tensors(case)
    ranks = [r[case.id] for r in results]
    check_ranks(case, ranks, reference_op(case, t), ["out", "dq"], ["dk", "dv"], dim=2)
    for rank, got in enumerate(ranks):
        assert (got["forward"], got["backward"]) == expected_bytes(case, rank, world), f"rank {rank} bytes"


def test_large_logits_overflow_a_naive_exp():
    case = next(c for c in op_cases(2) if c.large_logits)
    t = tensors(case)
    logits = t["q"] @ t["k"].repeat_interleave(2, dim=1).transpose(-1, -2) * case.scale
    assert torch.exp(logits).isinf().any()


@pytest.mark.parametrize("index", range(len(layer_cases(2))), ids=[c.id for c in layer_cases(2)])
def test_layer_matches_reference(distributed, index):
    world, results = distributed
    case = layer_cases(world)[index]
    assert case.id == layer_cases(2)[index].id
    t = tensors(case)
    block = make_block(case)
    text, visual = t["q"].clone().requires_grad_(), t["k"].clone().requires_grad_()
    q = block.queries(text)
    y = text + block.branch(cross_attention_reference(q, *block.keys_values(visual), **mask_args(t)))
    names, params = zip(*block.named_parameters())
    dtext, dvisual, *dparams = torch.autograd.grad((y * t["g"]).sum(), (text, visual, *params))
    ranks = [r[case.id] for r in results]
    check_ranks(case, ranks, dict(out=y.detach(), dtext=dtext, dvisual=dvisual), ["out", "dtext"], ["dvisual"], dim=1)

    kv_names = {n for n, p in block.named_parameters() if any(p is kv for kv in block.kv_parameters())}
    for name, grad in zip(names, dparams):
        if case.q_sharded or name in kv_names:  # per-rank shares: their sum is the gradient
            assert_exact(sum(r["grads"][name] for r in ranks), grad, f"sum over ranks of {name}.grad")
        else:  # text side with replicated queries: complete on every rank
            for rank, got in enumerate(ranks):
                assert_exact(got["grads"][name], grad, f"rank {rank} {name}.grad")
    if case.recompute:  # only text, visual and the attention's (O, LSE) are kept
        for rank, got in enumerate(ranks):
            lq = case.q_lens[rank] if case.q_sharded else case.q_lens[0]
            inputs = 2 * (lq * 16 + case.kv_lens[rank] * 12)
            assert got["saved"] == 8 * (inputs + 2 * 4 * lq * (4 + 1)), f"rank {rank} saved bytes"


def test_lengths_given_beforehand_change_nothing(distributed):
    """Passing `shard_lengths` skips the per-call shape exchange; outputs, gradients and bytes are identical."""
    world, results = distributed
    cases = [c for c in op_cases(world) if c.name in ("uneven_empty", "masked")]
    assert cases
    for case in cases:
        for rank, got in enumerate(results):
            with_lengths = got[f"{case.id}-lengths"]
            for name in ("out", "dq", "dk", "dv", "forward", "backward"):
                expected, actual = got[case.id][name], with_lengths[name]
                same = torch.equal(actual, expected) if isinstance(expected, torch.Tensor) else actual == expected
                assert same, f"{case.id} rank {rank} {name}"
    for rank, got in enumerate(results):
        assert f"lengths say rank {rank} holds 4 queries and 2 keys, but it holds 3 and 2" in got["lengths_error"]


def test_strided_inputs_give_the_results_of_contiguous_ones(distributed):
    """Views (slices of larger tensors) for q, k, v, the key-padding mask and the segment ids, through the op and
    the layer: the same outputs, gradients and bytes as contiguous inputs, bit for bit."""
    world, results = distributed
    for case in strided_cases(world):
        assert any(got[f"{case.id}-contiguous"] for got in results), case.id  # some rank holds views
        for rank, got in enumerate(results):
            contiguous = got[f"{case.id}-contiguous"]  # an empty shard has nothing to be strided
            assert not any(contiguous.values()), f"{case.id} rank {rank}: {contiguous}"
            expected, actual = got[case.id], got[f"{case.id}-strided"]
            for name in expected.keys() - {"saved"}:
                want, have = expected[name], actual[name]
                if isinstance(want, dict):
                    assert want.keys() == have.keys() and all(torch.equal(want[n], have[n]) for n in want), name
                else:
                    same = torch.equal(have, want) if isinstance(want, torch.Tensor) else have == want
                    assert same, f"{case.id} rank {rank} {name}"


def test_replicated_queries_of_different_lengths_fail_on_every_rank(distributed):
    _, results = distributed
    for rank, got in enumerate(results):
        assert "q_sharded=False needs the same queries on every rank" in got["mismatch_error"], rank


@pytest.mark.parametrize("case", op_cases(1), ids=lambda c: c.id)
def test_single_process_equals_plain_attention(case):
    """P = 1 without any process group (group=None and torch.distributed not initialized)."""
    t = tensors(case)
    got = run_op(case, {n: x.clone() for n, x in t.items()})
    expected = reference_op(case, t)
    for name in ("out", "dq", "dk", "dv"):
        assert_exact(got[name], expected[name], name)
    assert got["forward"] == got["backward"] == 0


def test_analytic_volumes_per_rank():
    """On an even split the counted formulas are the docs' volumes: LV-XAttn's ring sends (P-1)/P·S_Q·H·(2D+1)
    elements forward (Q blocks out, O and LSE accumulators: the paper's ≈ 2·S_Q·D per head), its gather
    schedule the same plus 2(P-1)/P·S_Q·H (the LSE max all-reduce) and the same backward, Ring
    (P-1)/P·2·S_KV·Hkv·D (K and V blocks)."""
    world, sq, skv, batch, heads, kv_heads, dim, size = 4, 12, 40, 2, 4, 2, 8, 8
    lv = Case("even", "lv_xattn", True, (sq // world,) * world, (skv // world,) * world)
    gather, ring = replace(lv, impl="lv_xattn_gather"), replace(lv, impl="ring")
    for rank in range(world):
        ring_forward, ring_backward = expected_bytes(lv, rank, world)
        assert ring_forward == (world - 1) * sq // world * heads * (2 * dim + 1) * batch * size
        assert expected_bytes(gather, rank, world) == (
            ring_forward + 2 * (world - 1) * sq // world * heads * batch * size, ring_backward)
        assert expected_bytes(ring, rank, world)[0] == (world - 1) * 2 * skv // world * kv_heads * dim * batch * size


def test_merge_of_two_empty_partials_stays_zero():
    empty = (torch.zeros(1, 1, 2, 3, dtype=F64), torch.full((1, 1, 2), float("-inf"), dtype=F64))
    out, lse = merge_partials(*empty, *empty)
    assert out.eq(0).all() and lse.eq(float("-inf")).all()
    big = (torch.ones(1, 1, 2, 3), torch.full((1, 1, 2), 1e30))
    out, lse = merge_partials(*big, *big)  # log(exp + exp) would overflow; logaddexp does not
    assert torch.allclose(out, torch.ones(1, 1, 2, 3)) and torch.isfinite(lse).all()


def test_masks_follow_ids_not_positions():
    q_ids, kv_ids = torch.tensor([[1, 2, 7]]), torch.tensor([[2, 1, 1, 2]])
    padding = torch.tensor([[False, False, True, False]])
    visible = visible_keys(q_ids, kv_ids, padding)
    assert visible.tolist() == [[[[False, True, False, False], [True, False, False, True], [False] * 4]]]


def test_block_starts_as_identity_and_recompute_keeps_only_inputs_and_o_lse():
    torch.manual_seed(0)
    block = CrossAttentionBlock(16, 4, kv_width=12, kv_heads=2, impl="local").double()
    text, visual = torch.randn(2, 5, 16, dtype=F64), torch.randn(2, 9, 12, dtype=F64, requires_grad=True)
    assert torch.equal(block(text, visual), text)  # zero-init layer-scale
    _, with_recompute = saved_activation_bytes(lambda: block(text, visual), exclude=block.parameters())
    block.recompute = False
    _, without = saved_activation_bytes(lambda: block(text, visual), exclude=block.parameters())
    assert with_recompute == 8 * (text.numel() + visual.numel() + 2 * 4 * 5 * (4 + 1))
    assert without > 2 * with_recompute


@pytest.mark.parametrize(("shapes", "message"), [
    (((1, 6, 3, 8), (1, 4, 5, 8), (1, 4, 5, 8)), "not a multiple of k/v's Hkv=4"),
    (((1, 4, 3, 8), (1, 4, 5, 8), (1, 4, 6, 8)), "must have the same shape"),
    (((1, 4, 3, 16), (1, 4, 5, 8), (1, 4, 5, 8)), "disagree on batch or head dim"),
])
def test_shape_errors_name_the_bad_value(shapes, message):
    q, k, v = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        lv_module.lv_xattn(q, k, v)


def test_unknown_schedule_is_an_error():
    q = torch.zeros(1, 1, 2, 8)
    with pytest.raises(ValueError, match=r"schedule='tree' is not one of \['gather', 'ring'\]"):
        lv_module.lv_xattn(q, q, q, schedule="tree")


def test_block_rejects_bad_heads_and_impl():
    with pytest.raises(ValueError, match="not a multiple of kv_heads 3"):
        CrossAttentionBlock(16, 4, kv_heads=3)
    with pytest.raises(ValueError, match="impl='flash'"):
        CrossAttentionBlock(16, 4, impl="flash")
    with pytest.raises(ValueError, match="pass both q_segment_ids and kv_segment_ids"):
        lv_module.lv_xattn(torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 3, 8), torch.zeros(1, 1, 3, 8),
                           q_segment_ids=torch.zeros(1, 2))
