"""Splitting amounts of money (integer cents)."""


def split(total: int, parts: int) -> list[int]:
    """`parts` amounts summing to `total`, differing by at most one cent, larger first.

    Raises ValueError when `parts` is not positive.
    """
    share = total // parts
    return [share] * parts
