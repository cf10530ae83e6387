from inventory.orders import line_total


def test_line_total():
    assert line_total(2.5, 4) == 10.0
