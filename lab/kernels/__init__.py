"""Tools around the Pallas kernels of :mod:`pallas_kernels` (which keeps only the kernels and their tuning):

- :mod:`~lab.kernels.device_check`: every kernel against its reference on a GPU or TPU;
- :mod:`~lab.kernels.bench`: kernel timings beside the device's measured ceilings;
- :mod:`~lab.kernels.lowering`: each kernel traced at serving shapes with ``impl="pallas"``;
- :mod:`~lab.kernels.tpu_compile` / :mod:`~lab.kernels.gpu_compile`: ahead-of-time compiles for deviceless targets.
"""
