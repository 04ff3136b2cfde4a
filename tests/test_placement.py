"""Placements and specs: parsing, printing, local shapes and the slices each device holds."""

from __future__ import annotations

import itertools
import math

import pytest

from autopar.placement import (
    Partial,
    Replicate,
    Shard,
    divides,
    format_spec,
    is_replicated,
    local_shape,
    parse_placement,
    parse_spec,
    shard_factor,
    shard_slices,
)

R, P = Replicate(), Partial()


@pytest.mark.parametrize(
    ("text", "placement"),
    [
        ("R", R),
        ("P", P),
        ("S(0)", Shard(0)),
        ("S(2)", Shard(2)),
        ("S(-1)", Shard(-1)),
        ("S(1)x3", Shard(1, 3)),
        (" S(0) ", Shard(0)),
    ],
)
def test_parse_placement(text, placement):
    assert parse_placement(text) == placement


@pytest.mark.parametrize("bad", ["", "Q", "S", "S()", "S(a)", "S(1)x", "s(0)", "R,R", "S(0)x3x2"])
def test_parse_placement_rejects_garbage_with_the_grammar(bad):
    with pytest.raises(ValueError, match=r"'R', 'P', 'S\(d\)' or 'S\(d\)xk'"):
        parse_placement(bad)


@pytest.mark.parametrize("spec", [("R",), ("S(0)", "R"), ("P", "S(1)x3"), ("S(0)", "S(0)", "R")])
def test_spec_text_round_trip(spec):
    assert format_spec(parse_spec(spec)) == spec


def test_parse_spec_accepts_a_single_string():
    assert parse_spec("S(1)") == (Shard(1),)


def test_str_and_short_format():
    assert [str(p) for p in (R, P, Shard(0), Shard(1, 3))] == ["R", "P", "S(0)", "S(1)x3"]
    assert format_spec((Shard(1, 3), R), short=True) == ("S(1)", "R")
    assert format_spec((Shard(1, 3), R)) == ("S(1)x3", "R")


def test_placements_are_hashable_values():
    assert Shard(0) == Shard(0, 1) != Shard(0, 2)
    assert len({R, Replicate(), P, Partial(), Shard(1), Shard(1)}) == 3
    assert is_replicated((R, R)) and not is_replicated((R, P)) and not is_replicated((Shard(0),))


@pytest.mark.parametrize(
    ("shape", "spec", "mesh", "expected"),
    [
        ((8, 12), ("S(0)", "S(1)"), (2, 3), (4, 4)),
        ((8, 12), ("R", "S(1)"), (2, 3), (8, 4)),
        ((8, 12), ("P", "R"), (2, 3), (8, 12)),
        ((16,), ("S(0)", "S(0)"), (2, 4), (2,)),  # nested: both axes cut dimension 0
        ((4, 12), ("S(1)x3",), (2,), (4, 6)),  # blocks: each of 3 blocks of 4 cut in two
        ((2, 3, 8), ("S(2)",), (8,), (2, 3, 1)),
    ],
)
def test_local_shape(shape, spec, mesh, expected):
    assert local_shape(shape, parse_spec(spec), mesh) == expected
    assert divides(shape, parse_spec(spec), mesh)


@pytest.mark.parametrize(
    ("shape", "spec", "mesh"),
    [
        ((6, 4), ("S(0)",), (4,)),
        ((8,), ("S(0)", "S(0)"), (4, 4)),  # 8 does not split 16 ways
        ((12, 8), ("S(0)x3",), (8,)),  # each block of 4 rows does not split 8 ways
        ((4,), ("S(1)",), (2,)),  # no dimension 1
    ],
)
def test_local_shape_rejects_uneven_shards(shape, spec, mesh):
    assert not divides(shape, parse_spec(spec), mesh)
    with pytest.raises(ValueError, match=r"does not divide|dimension"):
        local_shape(shape, parse_spec(spec), mesh)


def test_shard_factor_multiplies_the_axes_that_cut_a_dimension():
    spec = parse_spec(("S(0)", "S(1)", "S(0)"))
    assert shard_factor(spec, (2, 3, 4), 0) == 8
    assert shard_factor(spec, (2, 3, 4), 1) == 3
    assert shard_factor(spec, (2, 3, 4), 2) == 1


def test_shard_slices_plain():
    spec = parse_spec(("S(0)", "S(1)"))
    assert shard_slices((8, 12), spec, (2, 3), (1, 2)) == [[(4, 8)], [(8, 12)]]
    assert shard_slices((8, 12), spec, (2, 3), (0, 0)) == [[(0, 4)], [(0, 4)]]


def test_shard_slices_nested_axes_first_axis_is_the_outer_split():
    spec = parse_spec(("S(0)", "S(0)"))
    # Axis 0 takes rows 8..16 for coordinate 1; axis 1 (size 4) takes piece 2 of those.
    assert shard_slices((16, 3), spec, (2, 4), (1, 2)) == [[(12, 14)], [(0, 3)]]
    assert shard_slices((16, 3), spec, (2, 4), (0, 3)) == [[(6, 8)], [(0, 3)]]


def test_shard_slices_blocks_hold_one_piece_of_every_block():
    # A fused QKV weight [in, 3*out] with out = 4: device 1 of 2 holds columns 2:4, 6:8, 10:12.
    assert shard_slices((2, 12), (Shard(1, 3),), (2,), (1,)) == [[(0, 2)], [(2, 4), (6, 8), (10, 12)]]


@pytest.mark.parametrize(
    ("shape", "spec", "mesh"),
    [
        ((8, 12), ("S(0)", "S(1)"), (2, 3)),
        ((16, 4), ("S(0)", "S(0)"), (2, 4)),
        ((4, 12), ("S(1)x3", "S(0)"), (2, 2)),
        ((8, 8, 4), ("S(2)", "R", "S(0)"), (2, 2, 2)),
    ],
)
def test_shard_slices_partition_the_tensor(shape, spec, mesh):
    """Over the devices that differ only on sharded axes, the pieces cover every element once,
    and each piece has the local shape."""
    parsed = parse_spec(spec)
    counts: dict[tuple[int, ...], int] = {}
    coords = itertools.product(
        *(range(n) if isinstance(p, Shard) else range(1) for p, n in zip(parsed, mesh))
    )
    for coord in coords:
        ranges = shard_slices(shape, parsed, mesh, coord)
        held = tuple(sum(hi - lo for lo, hi in r) for r in ranges)
        assert held == local_shape(shape, parsed, mesh)
        for idx in itertools.product(*[[i for lo, hi in r for i in range(lo, hi)] for r in ranges]):
            counts[idx] = counts.get(idx, 0) + 1
    assert len(counts) == math.prod(shape)
    assert set(counts.values()) == {1}
