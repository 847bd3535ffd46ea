"""The Ray deployment the Ray tests and benchmarks serve from: a ``ray.cluster_utils.Cluster`` of two "nodes" on this
machine (the head offers the custom resource ``prefill``, the second node ``decode``) and the server's config for it,
built the way ``python -m phaseserve.server experiment.backend=ray`` builds it, each phase's actor placed on its own
node."""

from __future__ import annotations

from typing import Any


def two_node_cluster() -> Any:
    """A started two-node cluster (one CPU each; the caller shuts it down: ``cluster.shutdown()``)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"prefill": 1},
                                                            "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"decode": 1})
    cluster.wait_for_nodes()
    return cluster


def ray_server_config(cluster: Any, overrides: list[str] = ()) -> Any:
    """``configs/server.yaml`` with ``overrides``, the Ray backend on ``cluster``, prefill and decode on their nodes."""
    from phaseserve.server.launch import compose

    return compose(list(overrides) + ["experiment.backend=ray", f"experiment.ray.address={cluster.address}",
                                      "+experiment.ray.prefill.resources.prefill=1",
                                      "+experiment.ray.decode.resources.decode=1"])
