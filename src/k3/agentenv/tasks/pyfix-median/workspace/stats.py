"""Small statistics helpers."""


def mean(xs):
    """Arithmetic mean of a non-empty sequence."""
    xs = list(xs)
    if not xs:
        raise ValueError("mean() of an empty sequence")
    return sum(xs) / len(xs)


def median(xs):
    """Median of a non-empty sequence; the mean of the two middle values for even lengths."""
    xs = sorted(xs)
    if not xs:
        raise ValueError("median() of an empty sequence")
    mid = len(xs) // 2
    return xs[mid]
