"""Cost formulas against hand arithmetic: NCCL bus-bandwidth collectives (α-β), the roofline, and
the ZeRO accounting of training state."""

from __future__ import annotations

import pytest

from autopar import Cluster, Link
from autopar.cost import (
    OPTIMIZER_BYTES_PER_PARAM,
    all_gather_cost,
    all_reduce_cost,
    all_to_all_cost,
    p2p_cost,
    reduce_scatter_cost,
    roofline_time,
    training_state_bytes,
)
from autopar.cost.compute import BACKWARD_FLOP_RATIO, op_flops

# α = 10 µs, B = 100 GB/s: round numbers so every expected value below is hand arithmetic.
LINK = Link(name="test", bandwidth=100e9, latency=10e-6)
GB = 1e9


def test_all_reduce_is_two_n_minus_one_steps_and_twice_the_bus_volume():
    # n = 4: 2·3 = 6 latency steps; 2·3/4 · 1 GB = 1.5 GB at 100 GB/s = 15 ms.
    assert all_reduce_cost(1 * GB, 4, LINK) == pytest.approx(6 * 10e-6 + 0.015)
    # n = 8, 64 MB: 14 steps; 2·7/8 · 64e6 / 1e11 = 1.12 ms.
    assert all_reduce_cost(64e6, 8, LINK) == pytest.approx(14 * 10e-6 + 1.12e-3)


def test_all_gather_reduce_scatter_and_all_to_all_move_n_minus_one_over_n():
    # n = 4, 1 GB: 3 latency steps; 3/4 · 1 GB / 100 GB/s = 7.5 ms.
    expected = 3 * 10e-6 + 7.5e-3
    assert all_gather_cost(1 * GB, 4, LINK) == pytest.approx(expected)
    assert reduce_scatter_cost(1 * GB, 4, LINK) == pytest.approx(expected)
    assert all_to_all_cost(1 * GB, 4, LINK) == pytest.approx(expected)
    # all-reduce = reduce-scatter + all-gather (the ring algorithm)
    assert all_reduce_cost(1 * GB, 4, LINK) == pytest.approx(
        reduce_scatter_cost(1 * GB, 4, LINK) + all_gather_cost(1 * GB, 4, LINK)
    )


def test_point_to_point_is_one_step():
    assert p2p_cost(1 * GB, LINK) == pytest.approx(10e-6 + 0.01)
    assert p2p_cost(0, LINK) == 0


@pytest.mark.parametrize("fn", [all_reduce_cost, all_gather_cost, reduce_scatter_cost, all_to_all_cost])
def test_collectives_on_one_device_or_zero_bytes_are_free(fn):
    assert fn(1 * GB, 1, LINK) == 0
    assert fn(0, 8, LINK) == 0
    assert fn(1 * GB, 2, LINK) > 0


def test_cost_grows_with_bytes_and_devices():
    assert all_reduce_cost(2 * GB, 8, LINK) > all_reduce_cost(1 * GB, 8, LINK)
    assert all_gather_cost(1 * GB, 8, LINK) > all_gather_cost(1 * GB, 2, LINK)


def test_roofline_takes_the_slower_of_compute_and_memory():
    dev = Cluster.preset("A100-80GB").device  # 312 TFLOP/s bf16, 2039 GB/s, at their plateau efficiencies
    flops, nbytes = 1e12, 1e6
    compute = flops / (312e12 * dev.compute_efficiency)
    assert roofline_time(flops, nbytes, dev, "bfloat16") == pytest.approx(compute)
    memory = 1e12 / (2039e9 * dev.memory_efficiency)
    assert roofline_time(1e3, 1e12, dev, "bfloat16") == pytest.approx(memory)
    # fp32 at the TF32 rate (156 TFLOP/s) takes twice the bf16 time; on the plain FP32 units
    # (19.5 TFLOP/s, PyTorch's default matmul precision) 16 times.
    assert roofline_time(flops, nbytes, dev, "tfloat32") == pytest.approx(2 * compute)
    assert roofline_time(flops, nbytes, dev, "float32") == pytest.approx(16 * compute)


def test_matmul_and_attention_flops():
    # [m, k] @ [k, n]: 2·m·n·k
    assert op_flops("mm", [(32, 64), (64, 16)], (32, 16)) == (2.0 * 32 * 16 * 64, "matmul")
    # addmm's matrix operand is its second argument
    assert op_flops("addmm", [(16,), (32, 64), (64, 16)], (32, 16))[0] == 2.0 * 32 * 16 * 64
    # linear on [b, s, k] with weight [n, k]
    assert op_flops("linear", [(2, 8, 64), (16, 64)], (2, 8, 16))[0] == 2.0 * 2 * 8 * 16 * 64
    # attention: 4·b·h·s_q·s_k·d
    q = (2, 4, 8, 16)
    assert op_flops("scaled_dot_product_attention", [q, q, q], q) == (4.0 * 2 * 4 * 8 * 8 * 16, "attention")
    assert op_flops("add", [(4, 4), (4, 4)], (4, 4)) == (16.0, "other")
    assert BACKWARD_FLOP_RATIO["matmul"] == 2.0


def test_mixed_precision_adamw_is_16_bytes_per_parameter():
    # bf16 weight (2) + bf16 grad (2) + fp32 master, m, v (12): ZeRO §3.1
    assert training_state_bytes(1, 2, optimizer="adamw", mixed_precision=True) == 16
    assert training_state_bytes(1e9, 2, mixed_precision=True) == 16e9
    # fp32 AdamW: weight, grad, m, v at 4 bytes each
    assert training_state_bytes(1, 4) == 16
    assert training_state_bytes(1, 4, optimizer="sgd") == 8
    assert OPTIMIZER_BYTES_PER_PARAM["adamw"] == 8


def test_training_state_sharding_follows_zero_stages():
    n = 1000.0
    # ZeRO-1 over 4: optimizer (12 B with the master copy) sharded, weight and grad (2 + 2) not.
    assert training_state_bytes(n, 2, mixed_precision=True, optimizer_shards=4) == n * (2 + 2 + 12 / 4)
    # ZeRO-3 over 8: everything sharded
    assert training_state_bytes(
        n, 2, mixed_precision=True, param_shards=8, grad_shards=8, optimizer_shards=8
    ) == (n * 16 / 8)


def test_unknown_optimizer_is_named():
    with pytest.raises(ValueError, match="lion"):
        training_state_bytes(1, 4, optimizer="lion")
