from src.kernels.switchback.convert import LINEAR_CHOICES, SwitchBackLinear, convert_to_switchback
from src.kernels.switchback.functions import VARIANTS, switchback_linear

__all__ = ["LINEAR_CHOICES", "VARIANTS", "SwitchBackLinear", "convert_to_switchback", "switchback_linear"]
