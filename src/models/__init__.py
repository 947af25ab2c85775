from src.models.clip import CLIP, build_model, count_parameters
from src.models.openclip_interop import load_openclip_checkpoint, load_openclip_state_dict
from src.models.video_clip import VideoCLIP, build_video_model

__all__ = [
    "CLIP", "VideoCLIP", "build_model", "build_video_model", "count_parameters", "load_openclip_checkpoint",
    "load_openclip_state_dict",
]
