"""Mobius' solvers (planner/partition.py): the MIP partition against exhaustive enumeration of every
partition under the same timing model, and the cross mapping on the paper's topologies."""
import dataclasses
import itertools
import random

import pytest

from tensorstow.planner.partition import StageProblem, cross_mapping, makespan, partition, sequential_mapping


def instance(seed: int, layers: int = 5, gpus: int = 2, microbatches: int = 2) -> StageProblem:
    r = random.Random(seed)
    n = lambda lo, hi: tuple(r.uniform(lo, hi) for _ in range(layers))  # noqa: E731
    s_f = n(1e8, 4e8)
    return StageProblem(t_f=n(0.05, 0.2), t_b=n(0.1, 0.4), s_f=s_f, s_b=tuple(2 * x for x in s_f),
                        a=n(1e6, 5e7), g=n(1e6, 5e7), gpus=gpus, microbatches=microbatches,
                        capacity=r.uniform(9e8, 1.6e9), bandwidth=r.uniform(2e9, 8e9))


def all_partitions(layers: int):
    for cuts in itertools.product((0, 1), repeat=layers - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [layers]
        yield tuple(zip(bounds, bounds[1:]))


@pytest.mark.parametrize("seed,update", [(s, False) for s in range(4)] + [(s, True) for s in range(4, 7)])
def test_the_mip_partition_is_the_best_of_every_partition(seed, update):
    """The paper's MIP, and with the CPU optimizer's updates (the [OURS] term)."""
    sp = instance(seed)
    if update:
        sp = dataclasses.replace(sp, u=tuple(random.Random(seed).uniform(0.05, 0.5) for _ in range(sp.layers)))
    times = {st: makespan(sp, st) for st in all_partitions(sp.layers)}
    feasible = {st: t for st, t in times.items() if t is not None}
    assert feasible and len(feasible) < len(times)  # the capacity rules some out
    best = min(feasible.values())
    got = partition(sp)
    assert got.feasible, got.message
    assert got.time_s == pytest.approx(best, rel=1e-6)
    assert makespan(sp, got.stages) == pytest.approx(got.time_s, rel=1e-6)  # the MIP's own timing agrees


def test_no_partition_fits_is_reported():
    sp = instance(0)
    tiny = StageProblem(**{**{f: getattr(sp, f) for f in ("t_f", "t_b", "s_f", "s_b", "a", "g", "gpus",
                                                           "microbatches", "bandwidth")}, "capacity": 1e6})
    r = partition(tiny)
    assert not r.feasible and "no partition fits" in r.message


def contention(mapping, root_complex):
    size = {rc: root_complex.count(rc) for rc in set(root_complex)}
    rc = [root_complex[g] for g in mapping]
    return sum((size[rc[i]] if rc[i] == rc[j] else 0) / (j - i)
               for i in range(len(mapping)) for j in range(i + 1, len(mapping)))


@pytest.mark.parametrize("topology", [(0, 0, 0, 0), (0, 0, 1, 1), (0, 1, 1, 1)])
def test_cross_mapping(topology):
    stages = 8
    cross, seq = cross_mapping(stages, topology), sequential_mapping(stages, len(topology))
    assert all(cross[j] == cross[j % len(topology)] for j in range(stages))  # stages j, j+N share a GPU
    assert sorted(cross[:len(topology)]) == list(range(len(topology)))
    assert contention(cross, topology) <= contention(seq, topology)
    if topology == (0, 0, 0, 0):
        assert cross == seq  # one root complex: nothing to gain
    if topology == (0, 0, 1, 1):  # Mobius Fig. 4b: adjacent stages on different root complexes
        assert all(topology[cross[j]] != topology[cross[j + 1]] for j in range(stages - 1))
        assert contention(cross, topology) < contention(seq, topology)
