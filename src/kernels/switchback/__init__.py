from src.kernels.switchback.convert import SwitchBackLinear, convert_to_switchback
from src.kernels.switchback.functions import VARIANTS, switchback_linear

__all__ = ["VARIANTS", "SwitchBackLinear", "convert_to_switchback", "switchback_linear"]
