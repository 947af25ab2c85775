"""Everything that spans processes: process-group setup and the collectives (distributed.py), the data- ×
sequence-parallel layout of the ranks (mesh.py), per-tensor statistics of FSDP2-sharded tensors
(sharded_norms.py), the distributed cross-attention (xattn/), and compile/FSDP2 applied to a built model
(parallelize.py, imported from its module: it needs the model package, which itself imports xattn)."""

from src.parallel.distributed import DistInfo, all_gather_with_grad, all_reduce_with_grad, init_distributed
from src.parallel.mesh import Mesh
from src.parallel.xattn import lv_xattn, ring_xattn

__all__ = [
    "DistInfo", "Mesh", "all_gather_with_grad", "all_reduce_with_grad", "init_distributed", "lv_xattn", "ring_xattn",
]
