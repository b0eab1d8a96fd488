"""Inventory helpers."""


def add_item(item, bucket=[]):
    """Return `bucket` with `item` appended; a new list when no bucket is given."""
    bucket.append(item)
    return bucket
