"""StableAdamW: AdamW with AdaFactor-style update clipping, per tensor.

Wortsman et al. 2023, "Stable and low-precision training for large-scale vision-language models"
(arXiv 2304.13013). Per tensor, with t its own step count starting at 1 (the authors' reference,
bias correction folded into beta):

    β̂ = β(1 − β^(t−1)) / (1 − β^t)                      for β1 and β2
    v ← β̂1·v + (1 − β̂1)·g
    u ← β̂2·u + (1 − β̂2)·g²
    RMS = sqrt(mean(g² / max(u, ε²)))                     (the updated u)
    η = lr / max(1, RMS / clip_threshold)
    θ ← θ·(1 − η·λ) − η·v / (sqrt(u) + ε)

`step()` also takes the fixed fp16 loss scale (`grad_scale`), can skip tensors whose gradient is
non-finite (`skip_nonfinite`, §3.6 of the paper) and can skip the whole step (`found_inf`), all
without a host sync: skips are device-side 0/1 masks and step counts are device tensors.

Three implementations compute the same update: a per-tensor loop, `torch._foreach_*` ops per (device,
dtype) bucket, and fused Triton kernels (stable_adamw_triton.py) for float32 CUDA buckets. The foreach
path launches a few kernels per tensor and is launch-bound on the GPU; the fused one launches three per
bucket.

FSDP2-sharded (DTensor) parameters update their local shards, while the RMS and the non-finite check are those
of the whole tensor (src/parallel/sharded_norms.py), so every rank clips and skips alike. The fused kernels reduce over
a local shard only, so sharded parameters take the foreach path.
"""

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from src.optim.stable_adamw_triton import fused_stable_adamw_step, triton_available
from src.parallel.sharded_norms import all_finite, local, sum_over_shards, whole_norms


class StableAdamW(Optimizer):
    """StableAdamW (see the module docstring for the update).

    After every `step()` these tensors are set for logging; reading them is the only sync:
      last_rms      1-D float32, the RMS of each parameter that had a gradient, in param_groups order
                    and then parameter order (a group that mixes devices or dtypes under foreach or fused is
                    listed bucket by bucket). Params whose `grad is None` are left out and a skipped
                    tensor reports 0. `rms_by_param()` pairs the entries with their parameters.
      last_skipped  0-dim int64, how many tensors skipped their update (all of them under found_inf).
      last_clipped  0-dim int64, how many tensors had RMS > clip_threshold, i.e. a clipped step size.
    """

    # GradScaler then hands over its found_inf flag instead of syncing on it (see step()).
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 2e-3,
        betas: tuple[float, float] = (0.9, 0.99),
        eps: float = 1e-6,
        weight_decay: float = 0.2,
        clip_threshold: float = 1.0,
        foreach: bool | None = None,
        fused: bool | None = None,
    ) -> None:
        """foreach and fused left at None pick for you: the fused Triton step for float32 CUDA params when triton
        is installed, else foreach. foreach=True or False asks for that path; fused=True requires float32 CUDA
        params and triton, and raises ValueError otherwise."""
        if fused and foreach:
            raise ValueError("StableAdamW: fused=True and foreach=True are exclusive; pass one of them")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            clip_threshold=clip_threshold,
            foreach=foreach,
            fused=fused,
        )
        super().__init__(params, defaults)
        self.last_rms: Tensor | None = None
        self.last_skipped: Tensor | None = None
        self.last_clipped: Tensor | None = None
        self._rms_params: list[Tensor] = []

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        _check_hyperparameters({**self.defaults, **param_group})
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["fused"]:
            for p in group["params"]:
                _check_fusable(p.device, p.dtype)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("fused", None)  # state dicts from before the fused path existed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # Optimizer only moves "step" onto the param's device for fused/capturable optimizers, but our
        # step counts take part in device-side math, so they must live next to their parameter.
        for p, state in self.state.items():
            if "step" in state:
                state["step"] = state["step"].to(device=p.device, dtype=torch.float32)

    def rms_by_param(self) -> list[tuple[Tensor, Tensor]]:
        """(parameter, 0-dim RMS tensor) for every entry of `last_rms`, without a sync."""
        if self.last_rms is None:
            return []
        return list(zip(self._rms_params, self.last_rms.unbind(), strict=True))

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        grad_scale: float | Tensor | None = None,
        skip_nonfinite: bool = False,
        found_inf: Tensor | None = None,
    ) -> Any:
        """One update of every parameter that has a gradient.

        grad_scale: a float or 0-dim tensor on the params' device (the fixed fp16 loss scale); gradients are
            divided by it on the fly, `p.grad` is left untouched.
        skip_nonfinite: a tensor whose gradient has an Inf/NaN keeps its parameter, moments and step count;
            the others step normally.
        found_inf: 0-dim tensor on the params' device; if nonzero nothing changes at all.
        """
        # torch.amp.GradScaler and our optimizer_step() pass these as attributes, as for torch's fused AdamW.
        grad_scale = grad_scale if grad_scale is not None else getattr(self, "grad_scale", None)
        found_inf = found_inf if found_inf is not None else getattr(self, "found_inf", None)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        kwargs = dict(grad_scale=grad_scale, skip_nonfinite=skip_nonfinite, found_inf=found_inf)
        rms, clipped, skipped, rms_params = [], [], [], []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            states = [self._init_state(p) for p in params]
            if group["foreach"] is not False or group["fused"]:
                buckets = _by_device_and_dtype(params, states)
                # A bucket can hold FSDP2 shards beside replicated 0-dim parameters; a shard decides for it.
                deciders = [next((p for p in ps if isinstance(p, DTensor)), ps[0]) for ps, _ in buckets]
                results = [
                    (_fused_update if _use_fused(group, p) else _multi_tensor_update)(ps, ss, group, **kwargs)
                    for p, (ps, ss) in zip(deciders, buckets, strict=True)
                ]
                chunks = [ps for ps, _ in buckets]
            else:
                chunks = [[p] for p in params]
                results = [_single_tensor_update(p, s, group, **kwargs) for p, s in zip(params, states, strict=True)]
            for chunk, (chunk_rms, keep) in zip(chunks, results, strict=True):
                rms.append(chunk_rms.view(-1))
                clipped.append((chunk_rms > group["clip_threshold"]).sum())
                if keep is not None:
                    skipped.append((~keep).sum())
                rms_params += chunk

        device = self.param_groups[0]["params"][0].device
        self._rms_params = rms_params
        self.last_rms = torch.cat([r.to(device) for r in rms]) if rms else torch.zeros(0, device=device)
        self.last_clipped = _total(clipped, device)
        self.last_skipped = _total(skipped, device)
        return loss

    def _init_state(self, p: Tensor) -> dict[str, Tensor]:
        if p.grad.is_sparse:
            raise RuntimeError("StableAdamW does not support sparse gradients")
        state = self.state[p]
        if not state:
            # A device tensor, not an int: a skipped tensor's count must stay put without the host knowing.
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state


def _single_tensor_update(
    p: Tensor,
    state: dict[str, Tensor],
    group: dict[str, Any],
    *,
    grad_scale: float | Tensor | None,
    skip_nonfinite: bool,
    found_inf: Tensor | None,
) -> tuple[Tensor, Tensor | None]:
    """Update one tensor; returns its RMS (0-dim float32) and whether it updated (0-dim bool, or None)."""
    theta, v, u, step = local(p), local(state["exp_avg"]), local(state["exp_avg_sq"]), state["step"]
    lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
    g = local(p.grad) if grad_scale is None else local(p.grad) / grad_scale

    keep = None if found_inf is None else found_inf == 0
    if skip_nonfinite:
        finite = all_finite(g.isfinite().all().view(1), [p])[0]
        keep = finite if keep is None else keep & finite
    if keep is not None:
        # A zero update weight alone would not do: 0·Inf is NaN. A zeroed gradient also gives RMS 0.
        g = torch.where(keep, g, 0)

    g2 = g * g
    w1, w2 = _gradient_weights(step + 1, group["betas"], keep)
    v.lerp_(g, w1.to(p.dtype))
    u.lerp_(g2, w2.to(p.dtype))
    rms = (sum_over_shards((g2 / u.clamp_min(eps**2)).sum().view(1), [p])[0] / p.numel()).sqrt().float()

    eta = lr / (rms / group["clip_threshold"]).clamp_min(1)
    if keep is not None:
        eta = eta * keep
    theta.mul_(1 - eta * wd)
    theta.sub_(eta * v / (u.sqrt() + eps))
    step.add_(1 if keep is None else keep)
    return rms, keep


def _multi_tensor_update(
    params: list[Tensor],
    states: list[dict[str, Tensor]],
    group: dict[str, Any],
    *,
    grad_scale: float | Tensor | None,
    skip_nonfinite: bool,
    found_inf: Tensor | None,
) -> tuple[Tensor, Tensor | None]:
    """The same update for tensors of one device and dtype, with `_foreach_*` ops.

    Per-tensor scalars (bias corrections, RMS, step sizes, masks) are 1-D device tensors, unbound into
    0-dim views where a foreach op needs one per tensor. Returns the RMS vector and the keep mask (or None).
    """
    thetas = [local(p) for p in params]
    exp_avgs = [local(s["exp_avg"]) for s in states]
    exp_avg_sqs = [local(s["exp_avg_sq"]) for s in states]
    steps = [s["step"] for s in states]
    lr, eps, wd, dtype = group["lr"], group["eps"], group["weight_decay"], params[0].dtype
    grads = [local(p.grad) for p in params]
    if grad_scale is not None:
        grads = torch._foreach_div(grads, grad_scale)

    keep = None
    if skip_nonfinite:
        # The max-norm is finite exactly when every element is; a 2-norm could overflow.
        keep = all_finite(torch.stack(torch._foreach_norm(grads, float("inf"))).isfinite(), params)
    if found_inf is not None:
        step_ok = found_inf == 0
        keep = step_ok.expand(len(params)) if keep is None else keep & step_ok
    if keep is not None:
        grads = [torch.where(k, g, 0) for k, g in zip(keep.unbind(), grads, strict=True)]

    w1, w2 = _gradient_weights(torch.stack(steps) + 1, group["betas"], keep)
    torch._foreach_lerp_(exp_avgs, grads, w1.to(dtype).unbind())
    torch._foreach_lerp_(exp_avg_sqs, torch._foreach_mul(grads, grads), w2.to(dtype).unbind())

    # mean(g² / max(u, ε²)) = ‖g / max(√u, ε)‖² / n, and √u is needed for the update anyway.
    denom = torch._foreach_sqrt(exp_avg_sqs)
    norms = torch.stack(torch._foreach_norm(torch._foreach_div(grads, torch._foreach_clamp_min(denom, eps))))
    # Divide rather than multiply by n^(-1/2): then RMS is exactly 1 when every g²/u is 1 (as on step 1).
    norms = torch._foreach_div(whole_norms(norms, params).unbind(), [math.sqrt(p.numel()) for p in params])
    rms = torch.stack(norms).float()

    eta = lr / (rms / group["clip_threshold"]).clamp_min(1)
    if keep is not None:
        eta = eta * keep
    if wd != 0:
        torch._foreach_mul_(thetas, (1 - eta * wd).to(dtype).unbind())
    # θ −= η·v/(√u + ε) as one addcdiv, by folding −η into the denominator. A skipped tensor has η = 0:
    # its denominator becomes −inf and v/−inf adds a zero.
    torch._foreach_add_(denom, eps)
    torch._foreach_div_(denom, (-eta).to(dtype).unbind())
    torch._foreach_addcdiv_(thetas, exp_avgs, denom)
    torch._foreach_add_(steps, 1 if keep is None else keep.float().unbind())
    return rms, keep


def _fused_update(
    params: list[Tensor],
    states: list[dict[str, Tensor]],
    group: dict[str, Any],
    *,
    grad_scale: float | Tensor | None,
    skip_nonfinite: bool,
    found_inf: Tensor | None,
) -> tuple[Tensor, Tensor | None]:
    """The same update for float32 CUDA tensors of one device, in three Triton kernel launches."""
    beta1, beta2 = group["betas"]
    return fused_stable_adamw_step(
        params,
        [p.grad for p in params],
        [s["exp_avg"] for s in states],
        [s["exp_avg_sq"] for s in states],
        [s["step"] for s in states],
        lr=group["lr"],
        beta1=beta1,
        beta2=beta2,
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        clip_threshold=group["clip_threshold"],
        grad_scale=grad_scale,
        skip_nonfinite=skip_nonfinite,
        found_inf=found_inf,
    )


def _use_fused(group: dict[str, Any], p: Tensor) -> bool:
    """Whether the bucket of `p` (its device and dtype) takes the fused path."""
    if isinstance(p, DTensor):
        if group["fused"]:
            raise ValueError("StableAdamW(fused=True) cannot step FSDP2-sharded (DTensor) parameters: its kernels "
                             "take the RMS of the local shard, not of the whole tensor; pass fused=None or False")
        return False
    if group["fused"] is None:
        # An explicit foreach=True asks for the foreach path.
        return group["foreach"] is None and p.is_cuda and p.dtype == torch.float32 and triton_available()
    if group["fused"]:
        _check_fusable(p.device, p.dtype)  # a state dict saved on the GPU can be loaded elsewhere
    return group["fused"]


def _check_fusable(device: torch.device, dtype: torch.dtype) -> None:
    if device.type != "cuda" or dtype != torch.float32:
        raise ValueError(
            f"StableAdamW(fused=True) needs float32 CUDA parameters, got {dtype} on {device}: "
            "pass fused=None (the default) or fused=False to use the foreach path"
        )
    if not triton_available():
        raise ValueError("StableAdamW(fused=True) needs triton (pip install triton); or pass fused=None/False")


def _gradient_weights(t: Tensor, betas: tuple[float, float], keep: Tensor | None) -> tuple[Tensor, Tensor]:
    """1 − β̂ for both moments at step t, β̂ = β(1 − β^(t−1))/(1 − β^t); 0 where a tensor is skipped."""
    # float64 because 1 − β^t cancels badly at small t: in float32, 1 − 0.99² is off by ~1e-6 relative.
    t = t.double()
    w1, w2 = (1 - beta * (1 - beta ** (t - 1)) / (1 - beta**t) for beta in betas)
    return (w1, w2) if keep is None else (w1 * keep, w2 * keep)


def _by_device_and_dtype(
    params: list[Tensor], states: list[dict[str, Tensor]]
) -> list[tuple[list[Tensor], list[dict[str, Tensor]]]]:
    """Foreach ops and the fused kernels need one device and dtype per call; order is kept within each bucket."""
    # torch's grouping runs in C++: a Python loop over the params would cost more host time than the fused
    # step spends launching its kernels.
    if not params:  # a group without gradients; torch's grouping refuses empty lists
        return []
    grouped = Optimizer._group_tensors_by_device_and_dtype([params], with_indices=True)
    return [(bucket, [states[i] for i in indices]) for (bucket,), indices in grouped.values()]


def _total(counts: list[Tensor], device: torch.device) -> Tensor:
    if not counts:
        return torch.zeros((), dtype=torch.int64, device=device)
    return torch.stack([c.to(device) for c in counts]).sum()


def _check_hyperparameters(group: dict[str, Any]) -> None:
    beta1, beta2 = group["betas"]
    checks = {
        "lr": (group["lr"], group["lr"] >= 0),
        "beta1": (beta1, 0 <= beta1 < 1),
        "beta2": (beta2, 0 <= beta2 < 1),
        # ε > 0 keeps g²/max(u, ε²) finite when a gradient and its second moment are both zero.
        "eps": (group["eps"], group["eps"] > 0),
        "weight_decay": (group["weight_decay"], group["weight_decay"] >= 0),
        "clip_threshold": (group["clip_threshold"], group["clip_threshold"] > 0),
    }
    for name, (value, ok) in checks.items():
        if not ok:
            raise ValueError(f"StableAdamW: invalid {name}: {value!r}")
