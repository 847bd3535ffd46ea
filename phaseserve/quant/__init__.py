"""Weight representations (plain, FP8, INT4) and the single matmul dispatch point the model uses."""

from phaseserve.quant.dispatch import dense, dequantize, grouped_dense, is_quantized

__all__ = ["dense", "dequantize", "grouped_dense", "is_quantized"]
