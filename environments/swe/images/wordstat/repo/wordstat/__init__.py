from wordstat.stats import count_words, longest_word

__all__ = ["count_words", "longest_word"]
