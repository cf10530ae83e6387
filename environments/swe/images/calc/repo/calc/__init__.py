from calc.ops import add, clamp, mean

__all__ = ["add", "clamp", "mean"]
