"""Searching."""


def binary_search(xs, target):
    """Index of `target` in the sorted list `xs`, or -1 when it is absent."""
    lo, hi = 0, len(xs) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if xs[mid] == target:
            return mid
        if xs[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1
