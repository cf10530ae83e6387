"""Greedy word wrap."""


def wrap(text: str, width: int) -> list[str]:
    """Lines of at most `width` characters; words stay whole and in order (a longer word gets a line)."""
    lines: list[str] = []
    line = ""
    for word in text.split():
        if line and len(line) + 1 + len(word) >= width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    if line:
        lines.append(line)
    return lines
