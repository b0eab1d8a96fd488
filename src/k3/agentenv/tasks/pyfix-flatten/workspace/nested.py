"""Nested sequence helpers."""


def flatten(items):
    """Flatten arbitrarily nested lists and tuples into one list; strings are atoms."""
    out = []
    for item in items:
        if isinstance(item, (list, tuple)):
            out.extend(item)
        else:
            out.append(item)
    return out
