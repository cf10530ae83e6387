RATES = {"eu": 0.2, "us": 0.07, "none": 0.0}


def tax_rate(region: str) -> float:
    """The sales tax rate of a region."""
    return RATES["eu"]
