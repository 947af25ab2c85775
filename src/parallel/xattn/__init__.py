"""Exact distributed cross-attention over sharded keys/values (docs/lv_xattn.md): LV-XAttn (`lv_xattn`, the
query blocks travel), the Ring-Attention baseline (`ring_xattn`, the key/value blocks travel), their shared
single-process math (core.py, with the reference `cross_attention_reference`) and communication (comm.py)."""

from src.parallel.xattn.comm import ShardLengths, shard_lengths
from src.parallel.xattn.core import cross_attention_reference
from src.parallel.xattn.lv import lv_xattn
from src.parallel.xattn.ring import ring_xattn

__all__ = ["ShardLengths", "cross_attention_reference", "lv_xattn", "ring_xattn", "shard_lengths"]
