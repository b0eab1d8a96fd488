"""Text helpers."""
import re


def slugify(text):
    """Lower-case ASCII slug: runs of non-alphanumerics become one '-', no leading/trailing '-'."""
    text = text.lower()
    return re.sub(r"[^a-z0-9]", "-", text)
