"""Identifier naming."""
import re


def camel_to_snake(name):
    """'parseHTTPResponse' -> 'parse_http_response'; acronyms stay together."""
    return re.sub(r"([A-Z])", r"_\1", name).lower().lstrip("_")
