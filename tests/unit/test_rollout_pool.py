"""How the generator pool cuts a batch into work units (its dispatch: tests/ray/test_generator_pool.py)."""

from cluster.roles.rollout_pool import unit_sizes


def test_unit_sizes_keep_whole_batches_for_one_generator_and_two_units_per_generator_otherwise():
    assert unit_sizes(8, 1, 0) == [8]
    assert unit_sizes(8, 2, 0) == [2, 2, 2, 2]
    assert unit_sizes(9, 2, 0) == [3, 3, 3]
    assert unit_sizes(5, 4, 0) == [1, 1, 1, 1, 1]
    assert unit_sizes(10, 2, 4) == [4, 4, 2]
    assert sum(unit_sizes(37, 3, 0)) == 37
