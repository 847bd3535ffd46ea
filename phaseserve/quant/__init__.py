"""Weight representations (plain, FP8, INT4) and the single matmul dispatch point the model uses.

- ``dispatch``: ``dense`` / ``grouped_dense`` / ``dequantize`` — the model's only matmul entry points.
- ``policy``: :class:`QuantPolicy` (tensor class -> :class:`Rep`), presets, per-phase resolution.
- ``quantize``: :func:`quantize_params` (RTN, or GPTQ with a calibration), :func:`abstract_quantized`.
- ``calibrate``: :func:`collect_calibration` (activation statistics from a plain forward), GPTQ.
- ``formats``: DeepSeek/GLM FP8 and compressed-tensors INT4 checkpoints -> FP8/INT4 weights.
- ``checkpoint``: orbax save/restore into target shardings.
- ``size_report``: bytes by tensor class and representation, counted or measured.
"""

from phaseserve.quant.dispatch import dense, dequantize, grouped_dense, is_quantized
from phaseserve.quant.policy import (
    PRESET_POLICIES,
    TENSOR_CLASSES,
    PolicyError,
    QuantPolicy,
    Rep,
    phase_policy,
    resolve_policy,
)
from phaseserve.quant.quantize import abstract_quantized, quantize_leaf, quantize_params, tensor_class

__all__ = [
    "PRESET_POLICIES", "TENSOR_CLASSES", "PolicyError", "QuantPolicy", "Rep", "abstract_quantized", "dense",
    "dequantize", "grouped_dense", "is_quantized", "phase_policy", "quantize_leaf", "quantize_params",
    "resolve_policy", "tensor_class",
]
