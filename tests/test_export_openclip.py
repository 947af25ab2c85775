"""scripts/export_openclip.py: a trained checkpoint becomes a file open_clip loads strictly, with the same
embeddings (layer-scale folded into the weights it scales)."""

import os
import stat
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from src.models.clip import build_model
from src.openclip_architectures import buildable_architectures, matching_architecture
from src.trainer.checkpoint import load_torch_file
from tests.conftest import ROOT, compose_config, data_overrides, run_train


def test_a_trained_checkpoint_exports_to_open_clip_with_the_same_embeddings(shapes, tmp_path):
    import open_clip

    run_dir = tmp_path / "run"
    run_train(["experiment=quickstart", *data_overrides(shapes), "data.eval_shards=null", f"trainer.run_dir={run_dir}",
               "trainer.progress=false", "data.batch_size=8", "data.num_workers=0", "trainer.max_steps=20",
               "trainer.log_every=10", "model.ls_init_value=0.1", "trainer.ema_decay=0.9"])  # layer-scale, to fold
    output = tmp_path / "export" / "tiny-clip.safetensors"
    output.parent.mkdir()
    result = subprocess.run([sys.executable, "scripts/export_openclip.py", str(run_dir / "checkpoints/step_00000020"),
                             "-o", str(output)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "open_clip architecture tiny-clip" in result.stdout and "add_model_config" in result.stdout
    # as readable as the json beside it (safetensors alone would leave it 0600)
    assert stat.S_IMODE(output.stat().st_mode) == stat.S_IMODE((output.parent / "tiny-clip.json").stat().st_mode)

    averaged = tmp_path / "export" / "tiny-clip-ema.safetensors"
    result = subprocess.run([sys.executable, "scripts/export_openclip.py", str(run_dir / "checkpoints/step_00000020"),
                             "-o", str(averaged), "--ema"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr

    open_clip.add_model_config(str(output.parent / "tiny-clip.json"))
    try:
        theirs, _, _ = open_clip.create_model_and_transforms("tiny-clip", pretrained=str(output))
        their_ema = open_clip.create_model("tiny-clip", pretrained=str(averaged))
    finally:  # open_clip's registry is the process's: leave it as the other tests expect it
        open_clip.factory._MODEL_CONFIGS.pop("tiny-clip")
        buildable_architectures.cache_clear()
    assert not any(name.endswith(".gamma") for name in theirs.state_dict())
    ema = load_torch_file(str(run_dir / "checkpoints/step_00000020/ema.pt"))
    assert torch.equal(their_ema.visual.conv1.weight, ema["visual.conv1.weight"])
    assert not torch.equal(their_ema.visual.conv1.weight, theirs.visual.conv1.weight)
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(compose_config(["experiment=quickstart"])),
                                              OmegaConf.load(run_dir / "config.yaml"))).model
    ours = build_model(cfg)
    ours.load_state_dict(load_torch_file(str(run_dir / "checkpoints/step_00000020/model.pt")))
    ours.eval(), theirs.eval()
    images, tokens = torch.randn(4, 3, 32, 32), torch.randint(1, 49407, (4, 16))
    tokens[:, 7] = 49407
    with torch.no_grad():
        torch.testing.assert_close(theirs.encode_image(images, normalize=True), ours.encode_image(images),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(theirs.encode_text(tokens, normalize=True), ours.encode_text(tokens),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overrides, name", [(["model=vit_b32"], "ViT-B-32"), (["model=vit_huge"], "ViT-H-14"),
                                             (["model=vit_l14", "model.quick_gelu=true"], "ViT-L-14-quickgelu"),
                                             (["model=vit_tiny"], None)])
def test_the_export_names_the_open_clip_architecture_it_is(overrides, name):
    model = OmegaConf.to_container(OmegaConf.structured(compose_config(overrides).model), enum_to_str=True)
    assert matching_architecture(model) == name


def test_a_checkpoint_outside_a_run_directory_is_refused(tmp_path):
    result = subprocess.run([sys.executable, "scripts/export_openclip.py", str(tmp_path / "nothing"), "-o",
                             str(tmp_path / "x.safetensors")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "names no checkpoint" in result.stderr
    assert not os.path.exists(tmp_path / "x.safetensors")
