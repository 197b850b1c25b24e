"""gpt-oss experts kept in MXFP4 on the Triton path: the holder of the checkpoint's tensors.

When the checkpoint is MXFP4 (``MoESpec.mxfp4_experts``, from its ``quantization_config``)
and the model is built where the Triton kernels run (CUDA, or the CPU under
``TRITON_INTERPRET=1``: ``kernels.dispatch.use_triton``), ``FusedMoE`` holds its experts as
``MXFP4Experts`` instead of de-quantized ``w13_weight`` / ``w2_weight`` and runs them through
``kernels.moe.fused_moe_mxfp4`` (de-quantized per tile in registers). The four uint8 tensors
are the checkpoint's own, loaded as stored (``gpt_oss_checkpoint`` only renames them):
``gate_up_proj_blocks`` ``[E, 2I, H/32, 16]`` and ``gate_up_proj_scales`` ``[E, 2I, H/32]``
(rows interleaved gate, up, gate, up, ...: the kernel reads them so), ``down_proj_blocks``
``[E, H, I/32, 16]`` and ``down_proj_scales`` ``[E, H, I/32]``. gpt-oss-20b's experts take
4.25 bits per weight (4 per code, 8 per 32-value scale): its 19.1e9 expert weights hold
10.2 GB instead of 38.2 GB in bfloat16.

Tensor parallelism: a rank holds its ``I / tp`` gate and up rows (rows ``2 * start`` to
``2 * (start + I / tp)`` of the interleaved tensor: any split works) and its columns of the
down projection as whole 32-value blocks, which needs ``I / tp`` to be a multiple of 32
(gpt-oss-20b's 2880: tp 1, 2, 3, 5, 6, 9, ...; not 4 or 8). When it is not, the experts are
de-quantized at load as on the CPU (``keeps_mxfp4`` logs why). The biases stay ``FusedMoE``'s
(bf16, de-interleaved). After loading, a NaN scale (255) or a block past the float range is
a load error naming the tensor, as on the de-quantizing path (``check_kept_pair``).
"""

from __future__ import annotations

import logging

import torch

from tokenwire.kernels.dispatch import use_triton
from tokenwire.kernels.moe import MXFP4Weight
from tokenwire.runtime.models.layers import ShardedModule, ShardLoads
from tokenwire.runtime.models.layers.quant.base import DummyInit, LinearLayer, ParamLayout
from tokenwire.runtime.models.layers.quant.unquantized import UnquantizedLinearMethod
from tokenwire.runtime.models.mxfp4 import BLOCK_SIZE, BYTES_PER_BLOCK, E8M0_NAN
from tokenwire.runtime.models.weights import split

logger = logging.getLogger(__name__)
MXFP4_TENSORS = (
    "gate_up_proj_blocks",
    "gate_up_proj_scales",
    "down_proj_blocks",
    "down_proj_scales",
)


def keeps_mxfp4(mxfp4_checkpoint: bool, hidden: int, local_width: int, tp_size: int) -> bool:
    """Whether a ``FusedMoE`` built now (under the target ``torch.device`` context) keeps an
    MXFP4 checkpoint's experts quantized: the Triton path runs there and this rank's share of
    the intermediate size and the hidden size are whole 32-value blocks."""
    if not mxfp4_checkpoint or not use_triton(torch.empty(0)):
        return False
    if hidden % BLOCK_SIZE or local_width % BLOCK_SIZE:
        logger.warning(
            "gpt-oss MXFP4 experts are de-quantized at load: with tensor parallel size %d "
            "each rank's intermediate share (%d) or the hidden size (%d) is not a multiple of "
            "the %d-value MXFP4 block",
            tp_size, local_width, hidden, BLOCK_SIZE,
        )  # fmt: skip
        return False
    return True


class _CheckedAfterLoading(UnquantizedLinearMethod):
    """No conversion after loading; the scales checked as ``dequantize_mxfp4`` checks them."""

    def process_weights_after_loading(self, layer: LinearLayer) -> None:
        for kind in ("gate_up_proj", "down_proj"):
            check_kept_pair(layer.param(f"{kind}_blocks"), layer.param(f"{kind}_scales"), kind)


def check_kept_pair(blocks: torch.Tensor, scales: torch.Tensor, kind: str) -> None:
    """ValueError (naming ``<kind>_scales`` / ``_blocks``) for an E8M0 NaN scale (255) or a
    value of 2 ** 128 or more (|code| >= 2 under scale 254, >= 4 under 253). Reads only the
    blocks under those two scales: no copy of the whole tensor."""
    if bool((scales == E8M0_NAN).any()):
        raise ValueError(f"{kind}_scales: holds the E8M0 NaN scale 255")
    high = scales >= 253
    if not bool(high.any()):
        return
    codes = blocks[high].to(torch.int32)  # [blocks under 253/254, 16]
    magnitude = torch.maximum(codes & 7, (codes >> 4) & 7).amax(dim=-1)  # 4: 2.0, 6: 4.0
    limit = torch.where(scales[high] == 254, 4, 6)
    if bool((magnitude >= limit).any()):
        raise ValueError(
            f"{kind}_blocks: has values of 2 ** 128 or more (|code| >= 2 with scale 254, or "
            ">= 4 with 253): past the float32 / bfloat16 range"
        )


class MXFP4Experts(ShardedModule, LinearLayer):
    """This rank's MXFP4 expert tensors (uint8, no gradients; see the module doc). A
    ``LinearLayer`` only for the loader's per-parameter layouts: dummy weights (random codes,
    scales of 0, i.e. ``2 ** -127``, as other quantized tensors get constant scales) and the
    post-load hook (no conversion; ``check_kept_pair``); ``FusedMoE`` runs it."""

    what = "experts' intermediate size"

    def __init__(self, num_experts: int, hidden: int, width: int, start: int, local: int) -> None:
        super().__init__()
        self.linear_method = _CheckedAfterLoading()
        self.num_experts, self.hidden, self.width = num_experts, hidden, width
        self.start, self.local = start, local
        e, h = num_experts, hidden
        shapes = {
            "gate_up_proj_blocks": (e, 2 * local, h // BLOCK_SIZE, BYTES_PER_BLOCK),
            "gate_up_proj_scales": (e, 2 * local, h // BLOCK_SIZE),
            "down_proj_blocks": (e, h, local // BLOCK_SIZE, BYTES_PER_BLOCK),
            "down_proj_scales": (e, h, local // BLOCK_SIZE),
        }
        for name, shape in shapes.items():
            dummy: DummyInit = "bits" if name.endswith("_blocks") else "scale"
            layout = ParamLayout(dtype=torch.uint8, dummy=dummy)
            self.register(name, torch.empty(shape, dtype=torch.uint8), layout)

    def pairs(self) -> tuple[MXFP4Weight, MXFP4Weight]:
        """((gate_up blocks, scales), (down blocks, scales)) for ``fused_moe_mxfp4``."""
        p = dict(self.named_parameters())
        return (
            (p["gate_up_proj_blocks"], p["gate_up_proj_scales"]),
            (p["down_proj_blocks"], p["down_proj_scales"]),
        )

    def shard_loads(self) -> ShardLoads:
        """Each checkpoint tensor whole (shard id ""): this rank's gate/up rows (dim 1) and
        its down blocks (dim 2)."""
        e, h, width, u8 = self.num_experts, self.hidden, self.width, torch.uint8
        g_in, g_width = h // BLOCK_SIZE, width // BLOCK_SIZE
        rows, row0 = 2 * self.local, 2 * self.start
        cols, col0 = self.local // BLOCK_SIZE, self.start // BLOCK_SIZE
        return {
            "gate_up_proj_blocks": {
                "": split((e, 2 * width, g_in, BYTES_PER_BLOCK), 1, row0, rows, dtype=u8)
            },
            "gate_up_proj_scales": {"": split((e, 2 * width, g_in), 1, row0, rows, dtype=u8)},
            "down_proj_blocks": {
                "": split((e, h, g_width, BYTES_PER_BLOCK), 2, col0, cols, dst_dim=2, dtype=u8)
            },
            "down_proj_scales": {"": split((e, h, g_width), 2, col0, cols, dst_dim=2, dtype=u8)},
        }

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden}, local_width={self.local}"
