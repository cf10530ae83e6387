from inventory.tax import tax_rate


def line_total(price: float, qty: int) -> float:
    return price * qty


def order_total(lines: list[tuple[float, int]], discount_pct: float = 0.0, region: str = "none") -> float:
    """Sum of the lines, less the discount (a percentage), plus the region's tax; rounded to cents."""
    subtotal = sum(line_total(p, q) for p, q in lines)
    discounted = subtotal - discount_pct
    return round(discounted * (1 + tax_rate(region)), 2)
