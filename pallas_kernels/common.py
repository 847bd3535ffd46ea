"""Helpers shared by the kernels: backend detection and the ``impl`` / ``interpret`` resolution."""

from __future__ import annotations

import jax


def backend() -> str:
    """'cpu', 'gpu' or 'tpu' for the default backend."""
    return jax.default_backend()


def resolve_impl(impl: str) -> str:
    """``"auto"`` -> the Pallas kernel on GPU/TPU, the reference on CPU."""
    if impl not in ("auto", "pallas", "reference"):
        raise ValueError(f"impl must be 'auto', 'pallas' or 'reference', got {impl!r}")
    if impl == "auto":
        return "reference" if backend() == "cpu" else "pallas"
    return impl


def resolve_interpret(interpret: bool | None) -> bool:
    """``None`` -> interpret mode exactly when running on the CPU."""
    return backend() == "cpu" if interpret is None else bool(interpret)
