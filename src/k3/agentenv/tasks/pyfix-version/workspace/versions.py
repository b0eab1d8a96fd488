"""Dotted version numbers."""


def compare_versions(a, b):
    """-1, 0 or 1 as version a is older than, equal to or newer than version b."""
    pa, pb = a.split("."), b.split(".")
    if pa < pb:
        return -1
    if pa > pb:
        return 1
    return 0
