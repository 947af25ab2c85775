"""model=openclip model.name=NAME builds open_clip's own architectures from the model JSONs it ships."""

import pytest
import torch

from src.models.clip import build_model
from src.models.openclip_interop import load_openclip_state_dict
from src.openclip_architectures import buildable_architectures
from src.trainer.preflight import ConfigurationError
from src.trainer.run import resolve
from tests.conftest import compose_config, compose_unresolved


@pytest.mark.parametrize("name", ["ViT-B-16", "ViT-L-14-336", "ViT-g-14", "ViT-bigG-14", "ViT-H-14-quickgelu"])
def test_openclip_state_dicts_load_strictly_into_ours_on_the_meta_device(name):
    import open_clip

    with torch.device("meta"):
        theirs = open_clip.create_model(name, device="meta")
    cfg = compose_config(["model=openclip", f"model.name={name}"]).model
    ours = build_model(cfg, "meta")
    their_state = theirs.state_dict()
    own = ours.state_dict()
    assert {k: v.shape for k, v in their_state.items() if k != "attn_mask"} == {
        k: v.shape for k, v in own.items() if not k.endswith(".gamma")}
    load_openclip_state_dict(ours, their_state)  # strict
    assert cfg.quick_gelu == name.endswith("quickgelu")


def test_architectures_we_cannot_build_are_refused_with_the_list_of_those_we_can():
    names = buildable_architectures()
    assert {"ViT-B-32", "ViT-bigG-14", "ViT-L-14-336"} <= set(names) and not any(n.startswith("RN") for n in names)
    for name, needs in (("RN50", "a ResNet"), ("ViT-B-16-SigLIP", "vision_cfg.timm_model_name"),
                        ("coca_ViT-B-32", "multimodal_cfg"), ("ViT-Q-99", "is not an architecture open_clip ships")):
        with pytest.raises(ConfigurationError, match=needs) as error:
            resolve(compose_unresolved(["model=openclip", f"model.name={name}"]))
        assert "choose one of: ViT-B-16," in str(error.value)
