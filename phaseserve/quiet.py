"""Quiet startup for the command-line entry points (``experiments/*.py``).

Importing this module silences jax's backend-probe INFO lines (``Unable to initialize backend 'tpu'`` on a machine
without that accelerator), which Hydra's INFO-level job logging would otherwise print first and write as the whole
content of every run's ``.log``. Warnings and errors from jax still show. One line at the top of an entry point::

    import phaseserve.quiet  # noqa: F401  (no backend-probe INFO lines)
"""

import logging

BACKEND_PROBE_LOGGER = "jax._src.xla_bridge"  # logs "Unable to initialize backend ..." at INFO

logging.getLogger(BACKEND_PROBE_LOGGER).setLevel(logging.WARNING)
