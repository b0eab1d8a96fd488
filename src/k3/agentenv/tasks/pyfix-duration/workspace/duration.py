"""Durations like 1h30m."""
import re

_UNITS = {"h": 3600, "m": 60, "s": 1}


def parse_duration(text):
    """Seconds in a duration such as '1h30m', '45s' or '2h5s'; ValueError on anything else."""
    if not re.fullmatch(r"(\d+[hms])+", text):
        raise ValueError("bad duration: %r" % text)
    total = 0
    for number, unit in re.findall(r"(\d)([hms])", text):
        total += int(number) * _UNITS[unit]
    return total
