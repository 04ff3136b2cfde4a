"""Cluster, devices and links: presets, validation (errors carry the arithmetic), which link a mesh
axis uses, and the dict round trip a Plan stores."""

from __future__ import annotations

import pytest

from autopar import Cluster, DeviceSpec, Link
from autopar.devices import GiB


def test_presets_carry_published_figures():
    cl = Cluster.preset("A100-80GB", gpus_per_node=8, nodes=2)
    assert cl.world_size == 16
    assert cl.device.memory == 80 * GiB
    assert cl.device.flops_for("bfloat16") == 312e12
    assert cl.device.flops_for("torch.float32") == 19.5e12  # plain FP32 (PyTorch's default matmul precision)
    assert cl.device.flops_for("tfloat32") == 156e12  # TF32 tensor cores
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


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("kwargs", "field", "why"),
    [
        ({"link_bandwidth": NAN}, "bandwidth", "not finite"),
        ({"link_bandwidth": INF}, "bandwidth", "not finite"),
        ({"link_latency": NAN}, "latency", "not finite"),
        ({"link_latency": INF}, "latency", "not finite"),
        ({"link_latency": -1e-6}, "latency", "negative"),
        ({"memory": NAN}, "memory", "not finite"),
        ({"memory": 0}, "memory", "zero"),
        ({"flops": NAN}, "peak_flops['float32']", "not finite"),
        ({"flops": INF}, "peak_flops['float32']", "not finite"),
        ({"memory_bandwidth": NAN}, "memory_bandwidth", "not finite"),
    ],
)
def test_non_finite_or_non_positive_figures_are_refused_naming_the_field(kwargs, field, why):
    """A NaN link bandwidth used to plan with zero communication; every figure is checked."""
    with pytest.raises(ValueError) as err:
        Cluster.local(2, **kwargs)
    msg = str(err.value)
    assert f"{field} must be a finite number" in msg and why in msg
    assert "measure it with autopar.runtime.calibrate" in msg or "bytes" in msg


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpus_per_node": 2.5}, "gpus_per_node must be a whole number >= 1, got 2.5 (not a whole number)"),
        ({"nodes": 0}, "nodes must be a whole number >= 1, got 0"),
        ({"nodes": NAN}, "nodes must be a whole number >= 1, got nan"),
        ({"nics_per_node": 1.5}, "nics_per_node must be a whole number >= 1, got 1.5"),
        ({"gpus_per_node": "8"}, "gpus_per_node must be a whole number >= 1, got '8' (str)"),
    ],
)
def test_counts_must_be_whole_numbers(kwargs, message):
    args = {"gpus_per_node": 8, "nodes": 1, **kwargs}
    with pytest.raises(ValueError) as err:
        Cluster.preset("A100-80GB", **args)
    assert message in str(err.value)
    assert "world size = nodes(" in str(err.value) or "nics_per_node" in message


def test_whole_float_counts_are_taken_as_ints():
    cl = Cluster.preset("A100-80GB", gpus_per_node=8.0, nodes=2.0)
    assert cl.world_size == 16 and isinstance(cl.gpus_per_node, int) and isinstance(cl.nodes, int)


def test_device_overheads_and_measured_rows_are_checked():
    base = Cluster.preset("H100-SXM")
    with pytest.raises(ValueError, match="kernel_overhead must be a finite number of seconds >= 0, got nan"):
        base.with_device(kernel_overhead=NAN)
    with pytest.raises(ValueError, match="compute_efficiency must be in"):
        base.with_device(compute_efficiency=NAN)
    with pytest.raises(ValueError, match="β must be a finite number"):
        Link(name="x", bandwidth=1e9, latency=1e-6, measured=(("all_reduce", 2, 1e-5, NAN),))
    with pytest.raises(ValueError, match="world_size >= 1"):
        Cluster.local(2.5)


def test_groups_sharing_a_nodes_nics_each_get_their_share():
    """Eight data-parallel groups (one per tensor-parallel rank) cross nodes at once: with a NIC
    per GPU each has its own; with one NIC per node (cloud Ethernet) each gets an eighth."""
    from autopar.mesh import Mesh

    dgx = Mesh((8, 8), Cluster.preset("H100-SXM", nodes=8))
    cloud = Mesh((8, 8), Cluster.preset("H100-SXM", nodes=8, nics_per_node=8, network="ethernet-400g"))
    one_nic = Mesh((8, 8), Cluster.preset("H100-SXM", nodes=8, network="ethernet-400g"))
    assert dgx.group(0).bus_bandwidth == 50e9 and cloud.group(0).bus_bandwidth == 50e9
    assert one_nic.group(0).nic_share == 1 / 8 and one_nic.group(0).bus_bandwidth == 50e9 / 8
    nbytes = 1e9
    assert one_nic.all_reduce_cost(nbytes, 0) == pytest.approx(2 * 7 / 8 * nbytes / (50e9 / 8), rel=1e-3)
    # One group over all 64 devices (pure data parallelism) has the node's NIC to itself.
    assert Mesh((64,), one_nic.cluster).group(0).nic_share == 1


def test_groups_spanning_racks_see_the_spine_oversubscription():
    cl = Cluster.preset("H100-SXM", nodes=4, nodes_per_rack=2, spine_oversubscription=4)
    flat = Cluster.preset("H100-SXM", nodes=4)
    assert "2 nodes a rack, 4:1 spine" in cl.describe()
    assert cl.racks_spanned((2, 2, 8), (1,)) == 1 and cl.racks_spanned((2, 2, 8), (0,)) == 2
    assert cl.axis_link((2, 2, 8), 1).bandwidth == flat.inter_node.bandwidth  # inside a rack
    assert cl.axis_link((2, 2, 8), 0).bandwidth == flat.inter_node.bandwidth / 4
    from autopar.mesh import Mesh

    slow, fast = Mesh((4, 8), cl), Mesh((4, 8), flat)
    assert slow.all_reduce_cost(1e9, 0) == pytest.approx(4 * fast.all_reduce_cost(1e9, 0), rel=0.01)
    assert Cluster.from_dict(cl.to_dict()) == cl
    with pytest.raises(ValueError, match="spine_oversubscription must be ≥ 1"):
        Cluster.preset("H100-SXM", nodes=4, nodes_per_rack=2, spine_oversubscription=0.5)
    with pytest.raises(ValueError, match="nodes_per_rack must be a whole number"):
        Cluster.preset("H100-SXM", nodes=4, nodes_per_rack=0)
