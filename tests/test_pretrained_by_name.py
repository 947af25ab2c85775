"""model.init_from=openclip:ARCH/TAG resolves through open_clip's pretrained registry and the Hugging Face cache.
The registry gets a tiny architecture and two tags; the cache is a Hugging Face cache layout in tmp_path holding a
state dict that OpenCLIP's own model wrote. Nothing touches the network: the hub is offline throughout."""

import huggingface_hub.constants
import pytest
import torch
from safetensors.torch import save_file

from src.models.clip import build_model
from src.trainer.preflight import check_init_from
from src.trainer.pretrained import load_pretrained
from tests.conftest import compose_config

ARCH = "ViT-test-tiny"
TINY = {"embed_dim": 16, "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 32, "layers": 2, "head_width": 16},
        "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}}
REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """open_clip knows ARCH with tags `cached` (in the cache) and `absent` (not): returns OpenCLIP's model."""
    import open_clip
    from open_clip import factory, pretrained

    monkeypatch.setitem(factory._MODEL_CONFIGS, ARCH, TINY)
    monkeypatch.setitem(pretrained._PRETRAINED, ARCH, {"cached": pretrained._pcfg(hf_hub="test-org/tiny-clip/"),
                                                       "absent": pretrained._pcfg(hf_hub="test-org/absent/")})
    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    theirs = open_clip.create_model(ARCH).eval()
    repo = cache / "models--test-org--tiny-clip"
    (repo / "snapshots" / REVISION).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    save_file({k: v.contiguous() for k, v in theirs.state_dict().items()},
              str(repo / "snapshots" / REVISION / "open_clip_model.safetensors"))
    return theirs


def test_cached_weights_by_name_load_offline_and_compute_openclips_embeddings(offline_hub):
    cfg = compose_config(["model=openclip", f"model.name={ARCH}", f"model.init_from=openclip:{ARCH}/cached"]).model
    check_init_from(cfg.init_from, cfg)
    ours = build_model(cfg).eval()
    path = load_pretrained(ours, cfg.init_from)
    assert path.endswith(f"{REVISION}/open_clip_model.safetensors")
    images, tokens = torch.randn(3, 3, 32, 32), torch.randint(1, 49407, (3, 16))
    tokens[:, -1] = 49407
    with torch.no_grad():
        torch.testing.assert_close(ours.encode_image(images), offline_hub.encode_image(images, normalize=True),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.encode_text(tokens), offline_hub.encode_text(tokens, normalize=True),
                                   rtol=1e-5, atol=1e-5)


def test_weights_neither_cached_nor_downloadable_stop_with_the_command_that_fetches_them(offline_hub):
    cfg = compose_config(["model=openclip", f"model.name={ARCH}", f"model.init_from=openclip:{ARCH}/absent"]).model
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE is set") as error:
        check_init_from(cfg.init_from, cfg)
    assert ("""python -c "from huggingface_hub import hf_hub_download; hf_hub_download('test-org/absent', """
            """'open_clip_pytorch_model.bin')\"""") in str(error.value)


def test_a_wrong_tag_or_architecture_is_refused_with_the_choices(offline_hub):
    cfg = compose_config(["model=openclip", f"model.name={ARCH}"]).model
    with pytest.raises(ValueError, match="no weights 'nope' for ViT-test-tiny: choose one of cached, absent"):
        check_init_from(f"openclip:{ARCH}/nope", cfg)
    tiny = compose_config(["model=vit_tiny"]).model
    with pytest.raises(ValueError, match=f"does not fit this model: .*Use model=openclip model.name={ARCH}"):
        check_init_from(f"openclip:{ARCH}/cached", tiny)
    openai = compose_config(["model=openclip", "model.name=ViT-B-32"]).model
    with pytest.raises(ValueError, match=r"quick_gelu=False \(the weights have True\).*Use model.quick_gelu=true"):
        check_init_from("openclip:ViT-B-32/openai", openai)


def test_an_openclip_file_still_loads_by_path(offline_hub, tmp_path):
    cfg = compose_config(["model=openclip", f"model.name={ARCH}"]).model
    path = tmp_path / "weights.bin"
    torch.save(offline_hub.state_dict(), path)
    check_init_from(f"openclip:{path}", cfg)
    ours = build_model(cfg).eval()
    load_pretrained(ours, f"openclip:{path}")
    assert torch.equal(ours.visual.conv1.weight, offline_hub.visual.conv1.weight)
