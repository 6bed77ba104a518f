"""The ``wgmma_sm90_narrow`` backend of ``sparse_mla_decode``: the NARROW build of
``kernels/nvfp4_mla_decode_sm90.cu`` on Hopper (sm_90a), for calls of few heads.

16 heads a block as the N of every ``wgmma`` (S^T = K.Q^T and O^T = V^T.P^T, m64n16k16), so no
MMA row is padding, where the ``wgmma_sm90`` backend pads 16 heads to its 64 (wgmma's M). One
consumer warpgroup holds the block's O^T in 64 registers a thread, and the register file this
frees runs two producer warpgroups, each gathering and dequantizing one of every tile's two
halves: at 16 heads the 64-head build's one producer is what binds. The kernel's header comment
describes the block's work.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from ..device import Device
from . import decode_sm90
from .attention import Attention, DecodeBackend

if TYPE_CHECKING:
    from .library import KernelLibrary

HEAD_TILE = decode_sm90.NARROW_HEAD_TILE
SPEC = decode_sm90.WgmmaAttentionSpec.of(1, 1, HEAD_TILE)


def specs(arch: str) -> tuple[decode_sm90.WgmmaAttentionSpec, ...]:
    return (SPEC,)


def attention(lib: KernelLibrary, device: Device, num_heads: int, dim_parts: int) -> Attention:
    """The attention kernel of a call: 16 heads a block, whole output rows, persistent blocks (at
    most as many as the GPU holds at once; ``lib.decode_blocks`` lowers that)."""
    spec = lib.spec(SPEC)
    launcher = lib.launcher(device.index, spec)
    blocks = decode_sm90.persistent_blocks(lib, launcher)
    q_map = functools.partial(decode_sm90.q_tensor_map, head_tile=HEAD_TILE)
    return Attention(launcher, HEAD_TILE, decode_sm90.BLOCK_N, max(blocks, 1), 1, False, q_map)


BACKEND = DecodeBackend("wgmma_sm90_narrow", 90, 90, specs, attention)
