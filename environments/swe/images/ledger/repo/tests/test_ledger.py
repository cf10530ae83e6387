from ledger import merge, split


def test_merge_overlapping():
    assert merge([(1, 3), (2, 5)]) == [(1, 5)]


def test_split_even_amount():
    assert split(300, 3) == [100, 100, 100]
