"""Cluster, devices and links: presets, validation (errors carry the arithmetic), which link a mesh
axis uses, and the dict round trip a Plan stores."""

from __future__ import annotations

import pytest

from autopar import Cluster, DeviceSpec, Link
from autopar.cluster import GiB


def test_presets_carry_published_figures():
    cl = Cluster.preset("A100-80GB", gpus_per_node=8, nodes=2)
    assert cl.world_size == 16
    assert cl.device.memory == 80 * GiB
    assert cl.device.flops_for("bfloat16") == 312e12
    assert cl.device.flops_for("torch.float32") == 156e12
    assert cl.device.flops_for("int64") == cl.device.flops_for("float32")
    assert cl.intra_node.bandwidth > 10 * cl.inter_node.bandwidth
    assert {"A100-80GB", "H100-SXM", "V100-32GB"} <= set(Cluster.presets())


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="A100-80GB") as err:
        Cluster.preset("TPU-v9")
    assert "TPU-v9" in str(err.value)


@pytest.mark.parametrize(
    ("mesh", "arithmetic"),
    [((4, 3), "4 × 3 = 12 ≠ world size 8"), ((16,), "(16,) = 16 devices ≠ world size 8")],
)
def test_bad_mesh_error_carries_the_arithmetic(mesh, arithmetic):
    cl = Cluster.preset("A100-80GB", gpus_per_node=8, nodes=1)
    with pytest.raises(ValueError) as err:
        cl.validate_mesh(mesh)
    assert arithmetic in str(err.value)
    assert "1 node(s) × 8 devices" in str(err.value)


def test_good_meshes_validate():
    cl = Cluster.preset("A100-80GB", gpus_per_node=8, nodes=2)
    for mesh in [(16,), (2, 8), (4, 4), (2, 2, 4)]:
        cl.validate_mesh(mesh)
    with pytest.raises(ValueError, match="smaller than 1"):
        cl.validate_mesh((0, 16))


def test_inner_axis_within_a_node_uses_nvlink_and_an_axis_spanning_nodes_uses_ib():
    cl = Cluster.preset("A100-80GB", gpus_per_node=8, nodes=2)
    nvlink, ib = cl.intra_node, cl.inter_node
    assert nvlink.name.startswith("NVLink") and ib.name.startswith("IB")
    assert cl.axis_link((2, 8), 1) == nvlink  # 8 consecutive ranks: one node
    assert cl.axis_link((2, 8), 0) == ib  # ranks 0 and 8: two nodes
    assert cl.axis_link((4, 4), 1) == nvlink
    assert cl.axis_link((4, 4), 0) == ib  # spans 16 ranks
    assert cl.axis_link((8, 2), 0) == ib
    assert cl.axis_link((16,), 0) == ib
    single = Cluster.preset("A100-80GB", gpus_per_node=8, nodes=1)
    assert single.axis_link((8,), 0) == single.intra_node
    assert single.axis_link((2, 4), 0) == single.intra_node


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpus_per_node": 0}, "at least one device"),
        ({"nodes": 0}, "at least one device"),
    ],
)
def test_cluster_validation(kwargs, message):
    base = Cluster.preset("A100-80GB")
    args = {
        "device": base.device,
        "gpus_per_node": 8,
        "nodes": 1,
        "intra_node": base.intra_node,
        "inter_node": base.inter_node,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        Cluster(**args)


def test_device_and_link_validation_names_the_bad_field():
    with pytest.raises(ValueError, match="peak_flops"):
        DeviceSpec(name="x", peak_flops={"float32": 0.0}, memory_bandwidth=1.0, memory=1)
    with pytest.raises(ValueError, match="memory_bandwidth"):
        DeviceSpec(name="x", peak_flops={"float32": 1.0}, memory_bandwidth=-1.0, memory=1)
    with pytest.raises(ValueError, match="compute_efficiency"):
        DeviceSpec(
            name="x", peak_flops={"float32": 1.0}, memory_bandwidth=1.0, memory=1, compute_efficiency=1.5
        )
    with pytest.raises(ValueError, match="bandwidth"):
        Link(name="x", bandwidth=0.0, latency=1e-6)


def test_local_cluster_uses_gloo_and_one_link():
    cl = Cluster.local(4)
    assert cl.world_size == 4 and cl.backend == "gloo"
    assert cl.axis_link((2, 2), 0) == cl.axis_link((2, 2), 1)
    with pytest.raises(ValueError, match="world_size >= 1"):
        Cluster.local(0)


def test_dict_round_trip():
    cl = Cluster.preset("H100-SXM", gpus_per_node=4, nodes=3).with_device(compute_efficiency=0.5)
    again = Cluster.from_dict(cl.to_dict())
    assert again == cl
    assert again.device.compute_efficiency == 0.5
    assert "3 node(s) × 4 H100-SXM" in cl.describe()
