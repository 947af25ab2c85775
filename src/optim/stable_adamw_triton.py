"""Fused Triton step for StableAdamW: the arithmetic of `_multi_tensor_update` in three kernel launches.

Design. The RMS of a tensor needs a reduction over the whole tensor before its step size is known, so the
update takes two streaming passes, each ONE launch over every tensor of a (device, dtype) bucket. The grid
is a flat work list of (tensor index, chunk index) pairs, built once per list of sizes and cached; each
program walks one chunk of `_CHUNK` elements in tiles of `_BLOCK`, finding its tensors through an int64
table of addresses (cached per set of addresses, so moved gradients cost one small non-blocking copy).
Pass 1 reads g and u, forms the new u and writes one partial sum of g²/max(u, ε²) and one non-finite flag
per program. A small finalize kernel, one program per tensor, adds the partials in a fixed order (so the
RMS is deterministic, no atomics), folds in found_inf, and writes the RMS, the keep mask, the step size and
the bias-correction weights, then advances the step counts. Pass 2 recomputes the new u rather than having
pass 1 store it: pass 1 may not write u before the keep mask is known, and either way the traffic is the
same 36 bytes per element (AdamW's floor is 28). A skipped tensor's programs return at once, so its
parameter, moments and step count are left bit for bit. Everything stays on the device: no host sync.

`fused_adamw_rms` reuses pass 1 (with `AFTER_ADAMW`) for the RMS of a step torch's AdamW has just taken: g and
its bias-corrected second moment read once, 8 bytes per element, where the multi-tensor ops of `rms.py` move 48.
"""

import functools
import itertools
import math

import torch
from torch import Tensor

from src.kernels.triton_interpreter import interpreting

try:
    import triton
    import triton.language as tl
except ImportError:  # the foreach path still works; fused_stable_adamw_step() says what is missing
    triton = None

_BLOCK = 1024  # elements per tile: 8 per thread at 4 warps, as two 16-byte loads per tensor
_CHUNK = 8 * _BLOCK  # elements per program; fewer programs means fewer partial sums and table reads
_NUM_WARPS = 4
_REDUCE_BLOCK = 256  # partial sums the finalize kernel reads at once
_CACHE_SIZE = 8  # address tables kept: gradients that alternate between a few buffers still hit


def triton_available() -> bool:
    return triton is not None




def fused_stable_adamw_step(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    clip_threshold: float,
    grad_scale: float | Tensor | None = None,
    skip_nonfinite: bool = False,
    found_inf: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """One StableAdamW step of float32 tensors on one CUDA device, in place; see `_multi_tensor_update`.

    Returns the RMS of each tensor (float32, 0 where skipped) and the keep mask (bool), or None for the
    mask when neither skip_nonfinite nor found_inf can skip anything.
    """
    if triton is None:
        raise RuntimeError("the fused StableAdamW step needs triton: pip install triton, or use fused=False")
    device = params[0].device
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"the fused StableAdamW step runs on CUDA tensors, not {device}; use fused=False")
    for name, t in (("grad_scale", grad_scale), ("found_inf", found_inf)):
        if isinstance(t, Tensor) and t.device != device:
            raise ValueError(f"{name} must be on {device}, like the parameters, not on {t.device}")

    n = len(params)
    table, aligned, (work, first, numels) = _tables(device, (params, grads, exp_avgs, exp_avg_sqs, steps))
    programs = work.shape[1]
    partial = torch.empty(programs, dtype=torch.float32, device=device)
    flags = torch.empty(programs, dtype=torch.int8, device=device) if skip_nonfinite else partial
    coef = torch.empty((4, n), dtype=torch.float32, device=device)  # w1, w2, −η, 1 − η·λ
    rms = torch.empty(n, dtype=torch.float32, device=device)
    keep = torch.empty(n, dtype=torch.bool, device=device)

    scale_mode = 0 if grad_scale is None else 2 if isinstance(grad_scale, Tensor) else 1
    streaming = dict(
        work=work,
        numels=numels,
        table=table,
        n=n,
        programs=programs,
        scale_ptr=grad_scale if scale_mode == 2 else partial,  # an unused pointer argument still needs a tensor
        scale=float(grad_scale) if scale_mode == 1 else 1.0,
        eps=eps,
        BLOCK=_BLOCK,
        CHUNK=_CHUNK,
        ALIGNED=aligned,
        SCALE_MODE=scale_mode,
        num_warps=_NUM_WARPS,
    )
    if programs:  # only when the bucket holds nothing but empty tensors is there no chunk to stream
        _rms_pass[(programs,)](partial=partial, flags=flags, BETA2=beta2, CHECK_FINITE=skip_nonfinite, **streaming)
    _finalize[(n,)](
        first, numels, table, n, partial, flags, partial if found_inf is None else found_inf, rms, keep, coef,
        lr, weight_decay, clip_threshold, BETA1=beta1, BETA2=beta2, CHECK_FINITE=skip_nonfinite,
        HAS_FOUND_INF=found_inf is not None, BLOCK=_REDUCE_BLOCK, num_warps=2,
    )  # fmt: skip
    if programs:
        _update_pass[(programs,)](keep=keep, coef=coef, **streaming)
    return rms, keep if skip_nonfinite or found_inf is not None else None


def fused_adamw_rms(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
    steps: list[Tensor], *, beta2: float, eps: float,
) -> Tensor:
    """RMS_t = ‖g / max(√û, ε)‖ / √n of each float32 tensor of one CUDA device after torch's AdamW stepped it
    (û = u / (1 − β2^t), t its device-side step count), as `rms.update_rms`'s multi-tensor path computes it.
    Raises ValueError where the tensors do not suit the kernels (the caller then takes that path)."""
    if triton is None:
        raise ValueError("the fused RMS needs triton")
    device = params[0].device
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"the fused RMS runs on CUDA tensors, not {device}")
    if any(s.device != device for s in steps):
        raise ValueError("the fused RMS needs the step counts on the parameters' device (fused AdamW keeps them so)")
    n = len(params)
    table, aligned, (work, first, numels) = _tables(device, (params, grads, exp_avgs, exp_avg_sqs, steps))
    programs = work.shape[1]
    partial = torch.zeros(max(programs, 1), dtype=torch.float32, device=device)
    rms = torch.empty(n, dtype=torch.float32, device=device)
    if programs:
        _rms_pass[(programs,)](
            work, numels, table, n, programs, partial, 1.0, partial, partial, eps, BETA2=beta2, CHECK_FINITE=False,
            AFTER_ADAMW=True, BLOCK=_BLOCK, CHUNK=_CHUNK, ALIGNED=aligned, SCALE_MODE=0, num_warps=_NUM_WARPS,
        )
    _rms_finalize[(n,)](first, numels, partial, rms, BLOCK=_REDUCE_BLOCK, num_warps=2)
    return rms


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _work_plan(device: torch.device, numels: tuple[int, ...], chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    """The grid's work list [2, programs] (tensor index, chunk index), each tensor's first program (with
    the total appended) and the sizes, on `device`."""
    counts = torch.tensor([math.ceil(n / chunk) for n in numels], dtype=torch.int64)
    first = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    tensor = torch.repeat_interleave(torch.arange(len(numels)), counts)
    work = torch.stack([tensor, torch.arange(int(first[-1])) - first[tensor]])
    return _to_device(work.int(), device), _to_device(first.int(), device), _to_device(torch.tensor(numels), device)


_Tables = tuple[Tensor, bool, tuple[Tensor, Tensor, Tensor]]
_tables_cache: dict[tuple, _Tables] = {}


def _tables(device: torch.device, lists: tuple[list[Tensor], ...]) -> _Tables:
    """The addresses [5, n] of params, grads, exp_avgs, exp_avg_sqs and steps; whether the first four are all
    16-byte aligned (then the kernels may use vector loads); and the work plan for the params' sizes."""
    # The step's host time before the first launch is exposed on an idle GPU: this lookup is all it does
    # per tensor here, with map() rather than a Python loop.
    key = (device, _CHUNK, tuple(map(Tensor.data_ptr, itertools.chain(*lists))))
    if key not in _tables_cache:
        _check_layouts(*lists)
        if len(_tables_cache) >= _CACHE_SIZE:
            _tables_cache.pop(next(iter(_tables_cache)))
        table = torch.tensor(key[2], dtype=torch.int64).view(len(lists), -1)
        aligned = bool((table[:4] % 16 == 0).all())
        plan = _work_plan(device, tuple(p.numel() for p in lists[0]), _CHUNK)
        _tables_cache[key] = (_to_device(table, device), aligned, plan)
    return _tables_cache[key]


def _check_layouts(params, grads, exp_avgs, exp_avg_sqs, steps) -> None:
    # The kernels walk each tensor's memory as one flat run, the same run for p, g, v and u.
    for p, *others in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        for t in (p, *others):
            if t.dtype != torch.float32 or not _is_dense(t) or t.stride() != p.stride():
                raise ValueError(
                    "the fused StableAdamW step needs float32 params, grads and moments that are dense and "
                    f"laid out alike; got {t.dtype} with strides {t.stride()} for a param with {p.stride()}"
                )
    if any(s.dtype != torch.float32 or s.numel() != 1 for s in steps):
        raise ValueError("the fused StableAdamW step needs float32 scalar step counts")


def _is_dense(t: Tensor) -> bool:
    """Non-overlapping and without gaps: sorted by stride, the dims are those of a contiguous tensor."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda dim: dim[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _to_device(t: Tensor, device: torch.device) -> Tensor:
    # Pinned and non-blocking: rebuilding a table must not make the step wait for the GPU.
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


if triton is not None:
    # Kernels take many scalars: one line per argument, as the formatter wants, would bury the arithmetic.
    # fmt: off

    @triton.jit
    def _power(BETA: tl.constexpr, k):
        """β^k in float64 (k an int32 ≥ 0) by squaring: exact enough, and unlike libdevice.pow it also runs in
        the interpreter. tl.full keeps β in float64; a bare float constant would be rounded to float32 first."""
        power = tl.full((), 1.0, tl.float64)
        base = tl.full((), BETA, tl.float64)
        while k > 0:
            power = tl.where(k % 2 == 1, power * base, power)
            base = base * base
            k = k // 2
        return power

    @triton.jit
    def _gradient_weight(t, BETA: tl.constexpr):
        """1 − β̂ at step t (float32 count), β̂ = β(1 − β^(t−1))/(1 − β^t), in float64 like the foreach path."""
        beta = tl.full((), BETA, tl.float64)
        power = _power(BETA, (t - 1).to(tl.int32))
        return (1.0 - beta * (1.0 - power) / (1.0 - power * beta)).to(tl.float32)

    @triton.jit
    def _root_bias_correction(t, BETA: tl.constexpr):
        """√(1 − β^t) at step t (float32 count), in float64 and then rounded, as rms.py's path computes it."""
        return tl.sqrt(1.0 - _power(BETA, t.to(tl.int32))).to(tl.float32)

    @triton.jit
    def _lerp(start, end, w):
        # torch's lerp formula, which is exact at w = 1 (step 1).
        return tl.where(w < 0.5, tl.fma(w, end - start, start), tl.fma(start - end, 1.0 - w, end))

    @triton.jit
    def _tile_ptrs(table, row, n, tensor, idx, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
        ptrs = tl.load(table + row * n + tensor).to(tl.pointer_type(tl.float32)) + idx
        if ALIGNED:  # the address came from memory, so Triton cannot see its alignment by itself
            ptrs = tl.max_contiguous(tl.multiple_of(ptrs, 16), BLOCK)
        return ptrs

    @triton.jit
    def _load(ptrs, idx, end, MASKED: tl.constexpr):
        if MASKED:
            x = tl.load(ptrs, mask=idx < end, other=0.0)
        else:  # full tiles go unmasked, so that the loads can be vectorized
            x = tl.load(ptrs)
        return x

    @triton.jit
    def _store(ptrs, x, idx, end, MASKED: tl.constexpr):
        if MASKED:
            tl.store(ptrs, x, mask=idx < end)
        else:
            tl.store(ptrs, x)

    @triton.jit
    def _scaled(g, scale_ptr, scale, SCALE_MODE: tl.constexpr):
        if SCALE_MODE == 1:
            g = tl.div_rn(g, scale)
        elif SCALE_MODE == 2:
            g = tl.div_rn(g, tl.load(scale_ptr).to(tl.float32))
        return g

    @triton.jit
    def _rms_tile(table, n, tensor, off, end, scale_ptr, scale, w2, eps,
                  BLOCK: tl.constexpr, ALIGNED: tl.constexpr, SCALE_MODE: tl.constexpr, MASKED: tl.constexpr,
                  AFTER_ADAMW: tl.constexpr):
        """(g / max(√û, ε))² over one tile, and where g is non-finite. StableAdamW (before its update): û is the
        new u = lerp(u, g², w2). After torch's AdamW step: û = u / (1 − β2^t), w2 holding √(1 − β2^t)."""
        idx = off + tl.arange(0, BLOCK)
        g = _load(_tile_ptrs(table, 1, n, tensor, idx, BLOCK, ALIGNED), idx, end, MASKED)
        g = _scaled(g, scale_ptr, scale, SCALE_MODE)
        u = _load(_tile_ptrs(table, 3, n, tensor, idx, BLOCK, ALIGNED), idx, end, MASKED)
        if AFTER_ADAMW:  # rms.py's rounding: g · (1 / max(√u / √(1 − β2^t), ε))
            x = g * tl.div_rn(1.0, tl.maximum(tl.div_rn(tl.sqrt_rn(u), w2), eps))
        else:  # as the foreach path: (g / max(√u, ε))², which is g²/max(u, ε²) without squaring ε
            x = tl.div_rn(g, tl.maximum(tl.sqrt_rn(_lerp(u, g * g, w2)), eps))
        return x * x, (g != g) | (tl.abs(g) == float("inf"))

    @triton.jit
    def _rms_pass(work, numels, table, n, programs, scale_ptr, scale, partial, flags, eps,
                  BETA2: tl.constexpr, CHECK_FINITE: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                  ALIGNED: tl.constexpr, SCALE_MODE: tl.constexpr, AFTER_ADAMW: tl.constexpr = False):
        """Per program: the sum of g²/max(û, ε²) over its chunk (`_rms_tile` says which û), and whether any g was
        non-finite."""
        pid = tl.program_id(0)
        tensor = tl.load(work + pid)
        start = tl.load(work + programs + pid).to(tl.int64) * CHUNK
        end = tl.minimum(start + CHUNK, tl.load(numels + tensor))
        step = tl.load(tl.load(table + 4 * n + tensor).to(tl.pointer_type(tl.float32)))
        if AFTER_ADAMW:
            w2 = _root_bias_correction(step, BETA2)
        else:
            w2 = _gradient_weight(step + 1.0, BETA2)
        args = (table, n, tensor)
        acc = tl.zeros((BLOCK,), tl.float32)
        bad = tl.zeros((BLOCK,), tl.int1)
        full = start + (end - start) // BLOCK * BLOCK
        for off in range(start, full, BLOCK):
            x, b = _rms_tile(*args, off, end, scale_ptr, scale, w2, eps, BLOCK, ALIGNED, SCALE_MODE, False,
                             AFTER_ADAMW)
            acc += x
            bad |= b
        if full < end:
            x, b = _rms_tile(*args, full, end, scale_ptr, scale, w2, eps, BLOCK, ALIGNED, SCALE_MODE, True,
                             AFTER_ADAMW)
            acc += x
            bad |= b
        tl.store(partial + pid, tl.sum(acc))
        if CHECK_FINITE:
            tl.store(flags + pid, tl.max(bad.to(tl.int8)))

    @triton.jit
    def _tensor_rms(first, numels, partial, flags, tensor, CHECK_FINITE: tl.constexpr, BLOCK: tl.constexpr):
        """(√(sum of the tensor's partial sums / its size) in float32, whether a program flagged it), the partial
        sums added in a fixed order: deterministic, no atomics."""
        lo = tl.load(first + tensor)
        hi = tl.load(first + tensor + 1)
        total = tl.zeros((BLOCK,), tl.float64)  # float64: a sum of n ones is then exactly n (RMS 1 on step 1)
        bad = tl.zeros((BLOCK,), tl.int8)
        for i in range(lo, hi, BLOCK):
            idx = i + tl.arange(0, BLOCK)
            total += tl.load(partial + idx, mask=idx < hi, other=0.0).to(tl.float64)
            if CHECK_FINITE:
                bad = tl.maximum(bad, tl.load(flags + idx, mask=idx < hi, other=0))
        # float64 sqrt and division are correctly rounded (float32 tl.sqrt is not).
        rms = tl.sqrt(tl.sum(total)) / tl.sqrt(tl.load(numels + tensor).to(tl.float64))
        return rms.to(tl.float32), tl.max(bad)

    @triton.jit
    def _rms_finalize(first, numels, partial, rms_out, BLOCK: tl.constexpr):
        """Per tensor: its RMS from the partial sums of `_rms_pass`."""
        tensor = tl.program_id(0)
        tl.store(rms_out + tensor, _tensor_rms(first, numels, partial, partial, tensor, False, BLOCK)[0])

    @triton.jit
    def _finalize(first, numels, table, n, partial, flags, found_inf, rms_out, keep_out, coef,
                  lr, weight_decay, clip_threshold, BETA1: tl.constexpr, BETA2: tl.constexpr,
                  CHECK_FINITE: tl.constexpr, HAS_FOUND_INF: tl.constexpr, BLOCK: tl.constexpr):
        """Per tensor: RMS, keep, the weights and step size for pass 2, and the step count update."""
        tensor = tl.program_id(0)
        rms, bad = _tensor_rms(first, numels, partial, flags, tensor, CHECK_FINITE, BLOCK)
        keep = tl.full((), 1, tl.int1)
        if CHECK_FINITE:
            keep = bad == 0
        if HAS_FOUND_INF:
            keep = keep & (tl.load(found_inf) == 0)
        rms = tl.where(keep, rms, 0.0)
        eta = tl.where(keep, tl.div_rn(lr, tl.maximum(tl.div_rn(rms, clip_threshold), 1.0)), 0.0)

        step_ptr = tl.load(table + 4 * n + tensor).to(tl.pointer_type(tl.float32))
        step = tl.load(step_ptr)
        tl.store(coef + tensor, _gradient_weight(step + 1.0, BETA1))
        tl.store(coef + n + tensor, _gradient_weight(step + 1.0, BETA2))
        tl.store(coef + 2 * n + tensor, -eta)
        tl.store(coef + 3 * n + tensor, 1.0 - eta * weight_decay)
        tl.store(rms_out + tensor, rms)
        tl.store(keep_out + tensor, keep)
        tl.store(step_ptr, step + keep.to(tl.float32))

    @triton.jit
    def _update_tile(table, n, tensor, off, end, scale_ptr, scale, w1, w2, neg_eta, decay, eps,
                     BLOCK: tl.constexpr, ALIGNED: tl.constexpr, SCALE_MODE: tl.constexpr, MASKED: tl.constexpr):
        idx = off + tl.arange(0, BLOCK)
        p_ptrs = _tile_ptrs(table, 0, n, tensor, idx, BLOCK, ALIGNED)
        v_ptrs = _tile_ptrs(table, 2, n, tensor, idx, BLOCK, ALIGNED)
        u_ptrs = _tile_ptrs(table, 3, n, tensor, idx, BLOCK, ALIGNED)
        g = _load(_tile_ptrs(table, 1, n, tensor, idx, BLOCK, ALIGNED), idx, end, MASKED)
        g = _scaled(g, scale_ptr, scale, SCALE_MODE)
        v = _lerp(_load(v_ptrs, idx, end, MASKED), g, w1)
        u = _lerp(_load(u_ptrs, idx, end, MASKED), g * g, w2)
        # The foreach path's rounding: θ·(1 − η·λ) + v / ((√u + ε) / −η).
        p = _load(p_ptrs, idx, end, MASKED) * decay + tl.div_rn(v, tl.div_rn(tl.sqrt_rn(u) + eps, neg_eta))
        _store(v_ptrs, v, idx, end, MASKED)
        _store(u_ptrs, u, idx, end, MASKED)
        _store(p_ptrs, p, idx, end, MASKED)

    @triton.jit
    def _update_pass(work, numels, table, n, programs, scale_ptr, scale, keep, coef, eps,
                     BLOCK: tl.constexpr, CHUNK: tl.constexpr, ALIGNED: tl.constexpr, SCALE_MODE: tl.constexpr):
        """Per program: v, u and θ over its chunk, unless its tensor is skipped."""
        pid = tl.program_id(0)
        tensor = tl.load(work + pid)
        if tl.load(keep + tensor):
            start = tl.load(work + programs + pid).to(tl.int64) * CHUNK
            end = tl.minimum(start + CHUNK, tl.load(numels + tensor))
            scalars = (tl.load(coef + tensor), tl.load(coef + n + tensor),  # w1, w2
                       tl.load(coef + 2 * n + tensor), tl.load(coef + 3 * n + tensor), eps)  # −η, 1 − η·λ
            full = start + (end - start) // BLOCK * BLOCK
            for off in range(start, full, BLOCK):
                _update_tile(table, n, tensor, off, end, scale_ptr, scale, *scalars, BLOCK, ALIGNED, SCALE_MODE, False)
            if full < end:
                _update_tile(table, n, tensor, full, end, scale_ptr, scale, *scalars, BLOCK, ALIGNED, SCALE_MODE, True)

    # fmt: on
