from textkit import slugify, wrap


def test_slugify_one_word():
    assert slugify("Hello") == "hello"


def test_wrap_short_text_is_one_line():
    assert wrap("a b", 10) == ["a b"]
