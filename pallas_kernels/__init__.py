"""Pallas kernels, one module per op, each with a plain-jnp reference beside the kernel."""
