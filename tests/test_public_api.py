"""The public API: the names a user imports come from their package (`from src.optim import StableAdamW`), each
package's `__all__` lists exactly them, and the packages import without triton (a GPU extra)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

PUBLIC = {
    "src.optim": ["StableAdamW", "build_optimizer", "build_scaler", "build_scheduler", "optimizer_step",
                  "param_groups"],
    "src.data": ["TrainLoader", "eval_batches"],
    "src.tools": ["inspect_shards", "make_shards", "make_synthetic_shapes", "make_synthetic_video_shards",
                  "make_synthetic_videos", "pack_videos"],
    "src.parallel": ["DistInfo", "Mesh", "all_gather_with_grad", "all_reduce_with_grad", "init_distributed",
                     "lv_xattn", "ring_xattn"],
    "src.parallel.xattn": ["ShardLengths", "cross_attention_reference", "lv_xattn", "ring_xattn", "shard_lengths"],
    "src.trainer": ["Trainer", "hydra_overrides_for_rank", "run"],
}
MODEL_AND_KERNEL = {
    "src.models": ["CLIP", "VideoCLIP", "build_model", "build_video_model", "count_parameters",
                   "load_openclip_checkpoint", "load_openclip_state_dict"],
    "src.kernels": ["SwitchBackLinear", "apply_kernels", "convert_to_switchback", "switchback_linear"],
}
# Packages that need no kernel of ours: importing them loads no module that imports triton.
WITHOUT_TRITON = ["src.data", "src.tools", "src.parallel"]


def missing_names(package: str, names: list[str]) -> list[str]:
    module = importlib.import_module(package)
    return [name for name in names if getattr(module, name, None) is None]


def test_public_names_import_from_their_package():
    for package, names in PUBLIC.items():
        assert not missing_names(package, names), f"{package} does not export {missing_names(package, names)}"
        assert sorted(importlib.import_module(package).__all__) == sorted(names), package


def test_model_and_kernel_names():
    for package, names in MODEL_AND_KERNEL.items():
        assert not missing_names(package, names), f"{package} does not export {missing_names(package, names)}"
        exported = importlib.import_module(package).__all__
        assert sorted(exported) == sorted(names), package


def test_public_api_names_the_same_objects_as_their_modules():
    from src.optim.stable_adamw import StableAdamW
    from src.parallel.xattn.lv import lv_xattn

    assert importlib.import_module("src.optim").StableAdamW is StableAdamW
    assert importlib.import_module("src.parallel").lv_xattn is lv_xattn


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


def test_packages_import_without_triton():
    """Triton is missing on a CPU-only install: every package, and every public name, still imports."""
    packages = [*PUBLIC, *MODEL_AND_KERNEL]
    result = run_python(f"""
        import importlib, sys

        sys.modules["triton"] = None  # `import triton` raises ImportError, find_spec finds nothing: not installed
        for package in {packages!r}:
            importlib.import_module(package)
        for package, names in {PUBLIC!r}.items():
            module = importlib.import_module(package)
            for name in names:
                getattr(module, name)
    """)
    assert result.returncode == 0, result.stderr[-3000:]


def test_light_packages_load_no_kernel_module():
    """The data path, the tools and the collectives load none of our Triton kernel modules (PyTorch itself may
    import triton, through torch._dynamo, when it is installed)."""
    result = run_python(f"""
        import importlib, sys
        for package in {WITHOUT_TRITON!r}:
            importlib.import_module(package)
        kernels = sorted(name for name, module in sys.modules.items() if name.startswith("src.")
                         and "import triton" in open(getattr(module, "__file__", None) or "/dev/null").read())
        assert not kernels, kernels
    """)
    assert result.returncode == 0, result.stderr[-3000:]
