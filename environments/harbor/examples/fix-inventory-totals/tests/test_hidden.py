from inventory.orders import order_total
from inventory.tax import tax_rate


def test_tax_by_region():
    assert tax_rate("us") == 0.07 and tax_rate("none") == 0.0


def test_discount_is_a_percentage():
    assert order_total([(10.0, 10)], discount_pct=10, region="none") == 90.0


def test_total_with_tax():
    assert order_total([(10.0, 1), (5.0, 2)], discount_pct=50, region="eu") == 12.0
