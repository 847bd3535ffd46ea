"""HBM bytes a Pallas kernel reads per call, computed from its BlockSpecs and grid (no kernel runs).

:func:`record_calls` replaces ``pallas_call`` with a recorder that keeps each call's grid, input BlockSpecs,
scalar-prefetch operands and inputs, and returns zeros of the output shape. :func:`read_bytes` then walks the
grid in order (last axis fastest) and charges an input's block whenever its block index differs from the
previous step's, which is exactly when the Pallas pipeline issues a new copy (TPU, and the block loads of a
Triton program whose block is read whole). Specs without a block shape (whole array, e.g. SMEM scales) are
charged once. Call the kernel eagerly (not under jit) so that scalar-prefetch operands are concrete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools

import jax
import numpy as np
from jax.experimental import pallas as pl


@dataclasses.dataclass
class Call:
    name: str
    grid: tuple[int, ...]
    in_specs: list
    prefetch: list  # concrete scalar-prefetch operands (numpy)
    inputs: list  # the operands the in_specs describe


@contextlib.contextmanager
def record_calls(monkeypatch):
    calls: list[Call] = []

    def fake(kernel, out_shape, *, grid_spec=None, grid=(), in_specs=None, name=None, **_):
        def run(*args):
            nsp = 0
            g, specs = grid, in_specs
            if grid_spec is not None:
                nsp = grid_spec.num_scalar_prefetch
                g, specs = grid_spec.grid, grid_spec.in_specs
            g = tuple(g) if isinstance(g, (tuple, list)) else (g,)
            calls.append(Call(name, g, list(specs), [np.asarray(a) for a in args[:nsp]], list(args[nsp:])))
            return jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), out_shape)
        return run

    monkeypatch.setattr(pl, "pallas_call", fake)
    yield calls


def block_bytes(spec, x) -> int:
    shape = getattr(spec, "block_shape", None)
    if shape is None:
        return x.size * x.dtype.itemsize
    return int(np.prod([1 if d is None else d for d in shape])) * x.dtype.itemsize


def read_bytes(call: Call) -> list[int]:
    """Bytes read per input of ``call`` over its whole grid."""
    total = [0] * len(call.inputs)
    last: list = [None] * len(call.inputs)
    for idx in itertools.product(*(range(n) for n in call.grid)):
        for i, (spec, x) in enumerate(zip(call.in_specs, call.inputs, strict=True)):
            if getattr(spec, "block_shape", None) is None or spec.index_map is None:
                if last[i] is None:
                    total[i], last[i] = block_bytes(spec, x), "whole"
                continue
            block = tuple(int(v) for v in spec.index_map(*idx, *call.prefetch))
            if block != last[i]:
                total[i] += block_bytes(spec, x)
                last[i] = block
    return total
