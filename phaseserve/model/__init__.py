"""Functional model: params pytrees, layers, GQA/MLA attention, MoE, the decoder stack, the HF loader."""
