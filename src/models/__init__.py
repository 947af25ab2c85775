from src.models.clip import CLIP, build_model, count_parameters
from src.models.openclip_interop import load_openclip_checkpoint, load_openclip_state_dict

__all__ = ["CLIP", "build_model", "count_parameters", "load_openclip_checkpoint", "load_openclip_state_dict"]
