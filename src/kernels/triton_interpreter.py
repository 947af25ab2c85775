"""Whether Triton kernels run in Triton's CPU interpreter (how CI tests them) rather than on a GPU."""

import os


def interpreting() -> bool:
    """TRITON_INTERPRET=1 runs kernels on CPU tensors; Triton reads it when a kernel is defined (on import)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
