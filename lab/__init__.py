"""The lab: everything around the serving library that measures, evaluates, trains and publishes.

``phaseserve`` (with ``pallas_kernels``) is the installable serving library; it imports nothing from here
(``tests/unit/test_import_graph.py`` enforces it). The lab imports the library, and ``experiments/`` imports the lab.

- :mod:`lab.bench`: benchmarks (engine speed, HTTP load, operating points, integrity, soak, TPU compile, ...);
- :mod:`lab.eval`: quality evaluation (perplexity, tool-call validity, cached decode);
- :mod:`lab.train`: training the shipped default model; :mod:`lab.data`: its corpus;
- :mod:`lab.figures`: the registry of published figures; :mod:`lab.planner`: the planner against them, and reports;
- :mod:`lab.markdown`: report tables;
- :mod:`lab.faults`: fault injection for the paged cache and its integrity layer;
- :mod:`lab.kernels`: kernel tools (device checks, kernel benchmarks, lowering and TPU/GPU compile checks).
"""
