"""Weight representations (plain, FP8, INT4): policies, quantization, calibration, checkpoint formats.

The quantized array types and the model's matmul dispatch (``dense`` / ``grouped_dense`` / ``dequantize``) are the
leaf module :mod:`phaseserve.qarrays`, below the model; everything here builds on the model.

- ``policy``: :class:`QuantPolicy` (tensor class -> :class:`Rep`), presets, per-phase resolution.
- ``quantize``: :func:`quantize_params` (RTN, or GPTQ with a calibration), :func:`abstract_quantized`.
- ``calibrate``: :func:`collect_calibration` (activation statistics from a plain forward), GPTQ.
- ``formats``: the published checkpoint layouts (DeepSeek/GLM FP8, compressed-tensors FP8 and INT4) -> FP8/INT4.
- ``loader``: :func:`load_checkpoint`, the one loader of every entry point (``phaseserve.load_checkpoint``).
- ``checkpoint``: orbax save/restore into target shardings (import it directly: it pulls in orbax).
- ``size_report``: bytes by tensor class and representation, counted or measured.
"""

from phaseserve.quant.calibrate import Calibration, collect_calibration
from phaseserve.quant.loader import load_checkpoint
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
    "abstract_quantized", "checkpoint_report", "collect_calibration", "load_checkpoint", "phase_policy",
    "preset_report", "quantize_leaf", "quantize_params",
    "resolve_policy", "size_report", "tensor_class",
]
