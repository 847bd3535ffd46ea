"""Weight representations (plain, FP8, INT4) and the single matmul dispatch point the model uses.

- ``dispatch``: ``dense`` / ``grouped_dense`` / ``dequantize`` — the model's only matmul entry points.
- ``policy``: :class:`QuantPolicy` (tensor class -> :class:`Rep`), presets, per-phase resolution.
- ``quantize``: :func:`quantize_params` (RTN, or GPTQ with a calibration), :func:`abstract_quantized`.
- ``calibrate``: :func:`collect_calibration` (activation statistics from a plain forward), GPTQ.
- ``formats``: DeepSeek/GLM FP8 and compressed-tensors INT4 checkpoints -> FP8/INT4 weights.
- ``checkpoint``: orbax save/restore into target shardings (import it directly: it pulls in orbax).
- ``size_report``: bytes by tensor class and representation, counted or measured.
"""

from phaseserve.quant.calibrate import Calibration, collect_calibration
from phaseserve.quant.dispatch import dense, dequantize, grouped_dense, is_quantized
from phaseserve.quant.formats import load_quantized_checkpoint
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
from phaseserve.quant.size_report import SizeReport, checkpoint_report, preset_report, size_report

__all__ = [
    "PRESET_POLICIES", "TENSOR_CLASSES", "Calibration", "PolicyError", "QuantPolicy", "Rep", "SizeReport",
    "abstract_quantized", "checkpoint_report", "collect_calibration", "dense", "dequantize", "grouped_dense",
    "is_quantized", "load_quantized_checkpoint", "phase_policy", "preset_report", "quantize_leaf", "quantize_params",
    "resolve_policy", "size_report", "tensor_class",
]
