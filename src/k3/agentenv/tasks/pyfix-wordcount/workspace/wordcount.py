"""Word statistics."""
import re


def word_counts(text):
    """Count words case-insensitively; words are runs of letters, digits and apostrophes."""
    counts = {}
    for word in text.split():
        counts[word] = counts.get(word, 0) + 1
    return counts
