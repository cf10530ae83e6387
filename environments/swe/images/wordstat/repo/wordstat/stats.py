"""Word statistics."""


def words(text):
    """The words of text, in order."""
    return [w for w in text.split(" ") if w]


def count_words(text):
    """How many words text holds."""
    return len(words(text))


def longest_word(text):
    """The longest word of text (the first one of that length); '' for a text without words."""
    best = ""
    for w in words(text):
        if len(w) > len(best):
            best = w
    return best
