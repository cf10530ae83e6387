from wordstat import count_words, longest_word


def test_count_words_with_spaces():
    assert count_words("a bb  ccc") == 3


def test_longest_word():
    assert longest_word("a bb ccc dd") == "ccc"


def test_empty_text():
    assert count_words("") == 0
    assert longest_word("") == ""
