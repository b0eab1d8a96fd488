"""Programmatic definitions of the shipped tasks; `build_all(out_dir)` writes them as task directories.

The shipped copies under `tasks/` are what episodes use; this module is how they were made
(`k3 agentenv tasks --rebuild` rewrites them, and a test checks that rebuilding reproduces the
shipped checksums). Expectations are written by hand for Python cases and file states, and computed
by running the reference fix (trusted code, on the host) for database states and command output.
Whether each task really discriminates — the original workspace scores 0, the reference solution
scores 1 — is checked through the real sandbox by `k3 agentenv tasks --verify` and the tests.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

from k3.fileio import loads_json

from ._case_runner import encode
from .tasks import FORMAT, _listing, build_sqlite, write_task


def V(x, tol: float = 0.0) -> dict:
    return {"value": encode(x), **({"tol": tol} if tol else {})}


def R(name: str) -> dict:
    return {"raises": name}


PYFIX_NOTE = ("\n\nThe code is in /workspace/{module}; the visible tests are in {test} (run them with "
              "`python3 -m unittest -v`). Fix the bug in {module} without changing the function "
              "names or signatures. Hidden tests check the fix on other inputs and check that "
              "behaviour that already worked still works.")

# Each task: id, module, test file, issue text, buggy source, fix edits [(old, new)], visible tests,
# import line and cases [(id, label, expression or statements, expectation)].
PYFIX = [
    dict(
        id="pyfix-median", module="stats.py", title="median of an even-length list",
        issue="`median([1, 2, 3, 4])` returns 3, but the median of an even number of values is the "
              "mean of the two middle values (2.5 here).",
        source='''"""Small statistics helpers."""


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
''',
        fix=[("    mid = len(xs) // 2\n    return xs[mid]\n",
              "    mid = len(xs) // 2\n    if len(xs) % 2:\n        return xs[mid]\n"
              "    return (xs[mid - 1] + xs[mid]) / 2\n")],
        tests='''    def test_mean(self):
        self.assertEqual(mean([1, 2, 3]), 2)

    def test_median_odd(self):
        self.assertEqual(median([3, 1, 2]), 2)

    def test_median_even(self):
        self.assertEqual(median([1, 2, 3, 4]), 2.5)
''',
        imports="from stats import mean, median",
        cases=[("p2p_mean", "P2P", "mean([1, 2, 3])", V(2.0)),
               ("p2p_median_odd", "P2P", "median([3, 1, 2])", V(2)),
               ("p2p_mean_empty", "P2P", "mean([])", R("ValueError")),
               ("p2p_median_empty", "P2P", "median([])", R("ValueError")),
               ("f2p_even", "F2P", "median([10, 2, 8, 4])", V(6.0)),
               ("f2p_pair", "F2P", "median((7, 1))", V(4.0)),
               ("f2p_same", "F2P", "median([5, 5])", V(5.0))]),
    dict(
        id="pyfix-slugify", module="textutils.py", title="slugify leaves repeated and edge dashes",
        issue="`slugify('Hello, World!')` returns 'hello--world-' but should return 'hello-world': "
              "every run of characters other than a-z and 0-9 must become a single '-', and the "
              "slug must not start or end with '-'.",
        source='''"""Text helpers."""
import re


def slugify(text):
    """Lower-case ASCII slug: runs of non-alphanumerics become one '-', no leading/trailing '-'."""
    text = text.lower()
    return re.sub(r"[^a-z0-9]", "-", text)
''',
        fix=[('    return re.sub(r"[^a-z0-9]", "-", text)\n',
              '    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")\n')],
        tests='''    def test_simple(self):
        self.assertEqual(slugify("abc"), "abc")

    def test_punctuation(self):
        self.assertEqual(slugify("Hello, World!"), "hello-world")
''',
        imports="from textutils import slugify",
        cases=[("p2p_plain", "P2P", "slugify('abc')", V("abc")),
               ("p2p_digits", "P2P", "slugify('A1')", V("a1")),
               ("p2p_empty", "P2P", "slugify('')", V("")),
               ("f2p_spaces", "F2P", "slugify('  Spaces  everywhere ')", V("spaces-everywhere")),
               ("f2p_edges", "F2P", "slugify('--a--b--')", V("a-b")),
               ("f2p_mixed", "F2P", "slugify('C++ & Rust: 2024!')", V("c-rust-2024"))]),
    dict(
        id="pyfix-chunk", module="listutils.py", title="chunk drops the last partial chunk",
        issue="`chunk([1, 2, 3, 4, 5], 2)` returns [[1, 2], [3, 4]] and silently drops 5; the last "
              "chunk may be shorter than n and must be kept.",
        source='''"""List helpers."""


def chunk(xs, n):
    """Split a sequence into consecutive slices of length n (the last one may be shorter)."""
    if n <= 0:
        raise ValueError("n must be positive")
    return [xs[i:i + n] for i in range(0, len(xs) - n + 1, n)]
''',
        fix=[("range(0, len(xs) - n + 1, n)", "range(0, len(xs), n)")],
        tests='''    def test_even(self):
        self.assertEqual(chunk([1, 2, 3, 4], 2), [[1, 2], [3, 4]])

    def test_bad_n(self):
        with self.assertRaises(ValueError):
            chunk([1], 0)
''',
        imports="from listutils import chunk",
        cases=[("p2p_even", "P2P", "chunk([1, 2, 3, 4], 2)", V([[1, 2], [3, 4]])),
               ("p2p_empty", "P2P", "chunk([], 2)", V([])),
               ("p2p_zero", "P2P", "chunk([1], 0)", R("ValueError")),
               ("p2p_str", "P2P", "chunk('abcdef', 3)", V(["abc", "def"])),
               ("f2p_odd", "F2P", "chunk([1, 2, 3, 4, 5], 2)", V([[1, 2], [3, 4], [5]])),
               ("f2p_short", "F2P", "chunk([1], 3)", V([[1]])),
               ("f2p_tuple", "F2P", "chunk((1, 2, 3), 2)", V([(1, 2), (3,)]))]),
    dict(
        id="pyfix-roman", module="roman.py", title="roman numerals without subtractive forms",
        issue="`to_roman(4)` returns 'IIII' and `to_roman(1994)` returns 'MDCCCCLXXXXIIII'; standard "
              "numerals use subtractive forms: 4 is 'IV', 9 'IX', 40 'XL', 90 'XC', 400 'CD', 900 'CM'.",
        source='''"""Roman numerals."""

NUMERALS = [(1000, "M"), (500, "D"), (100, "C"), (50, "L"), (10, "X"), (5, "V"), (1, "I")]


def to_roman(n):
    """Roman numeral for 1 <= n <= 3999."""
    if not 0 < n < 4000:
        raise ValueError("n must be in 1..3999")
    out = []
    for value, symbol in NUMERALS:
        while n >= value:
            out.append(symbol)
            n -= value
    return "".join(out)
''',
        fix=[('NUMERALS = [(1000, "M"), (500, "D"), (100, "C"), (50, "L"), (10, "X"), (5, "V"), (1, "I")]',
              'NUMERALS = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),\n'
              '            (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]')],
        tests='''    def test_small(self):
        self.assertEqual(to_roman(3), "III")

    def test_four(self):
        self.assertEqual(to_roman(4), "IV")
''',
        imports="from roman import to_roman",
        cases=[("p2p_one", "P2P", "to_roman(1)", V("I")),
               ("p2p_eight", "P2P", "to_roman(8)", V("VIII")),
               ("p2p_2023", "P2P", "to_roman(2023)", V("MMXXIII")),
               ("p2p_zero", "P2P", "to_roman(0)", R("ValueError")),
               ("f2p_nine", "F2P", "to_roman(9)", V("IX")),
               ("f2p_1994", "F2P", "to_roman(1994)", V("MCMXCIV")),
               ("f2p_3999", "F2P", "to_roman(3999)", V("MMMCMXCIX")),
               ("f2p_40", "F2P", "to_roman(40)", V("XL"))]),
    dict(
        id="pyfix-wordcount", module="wordcount.py", title="word counts are case and punctuation sensitive",
        issue="`word_counts('The cat. the CAT!')` returns {'The': 1, 'cat.': 1, 'the': 1, 'CAT!': 1}; "
              "words are runs of letters, digits and apostrophes, compared case-insensitively "
              "(lower-cased), so the answer is {'the': 2, 'cat': 2}.",
        source='''"""Word statistics."""
import re


def word_counts(text):
    """Count words case-insensitively; words are runs of letters, digits and apostrophes."""
    counts = {}
    for word in text.split():
        counts[word] = counts.get(word, 0) + 1
    return counts
''',
        fix=[("    for word in text.split():\n",
              "    for word in re.findall(r\"[a-z0-9']+\", text.lower()):\n")],
        tests='''    def test_simple(self):
        self.assertEqual(word_counts("a b a"), {"a": 2, "b": 1})

    def test_case(self):
        self.assertEqual(word_counts("The cat. the CAT!"), {"the": 2, "cat": 2})
''',
        imports="from wordcount import word_counts",
        cases=[("p2p_simple", "P2P", "word_counts('a b a')", V({"a": 2, "b": 1})),
               ("p2p_empty", "P2P", "word_counts('')", V({})),
               ("f2p_apostrophe", "F2P", "word_counts(\"Don't stop, don't!\")",
                V({"don't": 2, "stop": 1})),
               ("f2p_digits", "F2P", "word_counts('R2D2 met r2d2; C3PO.')",
                V({"r2d2": 2, "met": 1, "c3po": 1})),
               ("f2p_lines", "F2P", "word_counts('One\\nTWO two\\n(three)')",
                V({"one": 1, "two": 2, "three": 1}))]),
    dict(
        id="pyfix-flatten", module="nested.py", title="flatten only flattens one level",
        issue="`flatten([1, [2, [3, [4]]]])` returns [1, 2, [3, [4]]]; it must flatten lists and "
              "tuples nested to any depth (strings are atoms and are not split).",
        source='''"""Nested sequence helpers."""


def flatten(items):
    """Flatten arbitrarily nested lists and tuples into one list; strings are atoms."""
    out = []
    for item in items:
        if isinstance(item, (list, tuple)):
            out.extend(item)
        else:
            out.append(item)
    return out
''',
        fix=[("            out.extend(item)\n", "            out.extend(flatten(item))\n")],
        tests='''    def test_one_level(self):
        self.assertEqual(flatten([1, [2, 3]]), [1, 2, 3])

    def test_deep(self):
        self.assertEqual(flatten([1, [2, [3, [4]]]]), [1, 2, 3, 4])
''',
        imports="from nested import flatten",
        cases=[("p2p_one", "P2P", "flatten([1, [2, 3]])", V([1, 2, 3])),
               ("p2p_empty", "P2P", "flatten([])", V([])),
               ("p2p_strings", "P2P", "flatten(['ab', 'c'])", V(["ab", "c"])),
               ("f2p_deep", "F2P", "flatten([[[['x']]], 'y'])", V(["x", "y"])),
               ("f2p_tuples", "F2P", "flatten([('a', ['b', ('c',)]), 'de'])", V(["a", "b", "c", "de"])),
               ("f2p_empty_nested", "F2P", "flatten([[], [[], [1]]])", V([1]))]),
    dict(
        id="pyfix-mutable-default", module="inventory.py", title="shared mutable default argument",
        issue="Calling `add_item('x')` and then `add_item('y')` returns ['x', 'y'] the second time: "
              "the default bucket is shared between calls. Without a bucket argument each call "
              "must start from a new empty list.",
        source='''"""Inventory helpers."""


def add_item(item, bucket=[]):
    """Return `bucket` with `item` appended; a new list when no bucket is given."""
    bucket.append(item)
    return bucket
''',
        fix=[("def add_item(item, bucket=[]):\n", "def add_item(item, bucket=None):\n"),
             ("    bucket.append(item)\n",
              "    if bucket is None:\n        bucket = []\n    bucket.append(item)\n")],
        tests='''    def test_given_bucket(self):
        self.assertEqual(add_item(1, [0]), [0, 1])

    def test_fresh_default(self):
        add_item("x")
        self.assertEqual(add_item("y"), ["y"])
''',
        imports="from inventory import add_item",
        cases=[("p2p_given", "P2P", "add_item(1, [0])", V([0, 1])),
               ("p2p_inplace", "P2P", "b = []\nadd_item(2, b)\nresult = b", V([2])),
               ("f2p_fresh", "F2P", "add_item('q')\nadd_item('r')\nresult = add_item('s')", V(["s"])),
               ("f2p_identity", "F2P", "result = add_item('a') is add_item('b')", V(False))]),
    dict(
        id="pyfix-bsearch", module="search.py", title="binary search misses the last element",
        issue="`binary_search([1, 3, 5, 7, 9], 9)` returns -1 although 9 is at index 4; some "
              "present elements are reported missing.",
        source='''"""Searching."""


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
''',
        fix=[("    while lo < hi:\n", "    while lo <= hi:\n")],
        tests='''    def test_middle(self):
        self.assertEqual(binary_search([1, 3, 5, 7, 9], 5), 2)

    def test_last(self):
        self.assertEqual(binary_search([1, 3, 5, 7, 9], 9), 4)
''',
        imports="from search import binary_search",
        cases=[("p2p_middle", "P2P", "binary_search([1, 3, 5, 7, 9], 5)", V(2)),
               ("p2p_absent", "P2P", "binary_search([1, 3, 5], 4)", V(-1)),
               ("p2p_empty", "P2P", "binary_search([], 1)", V(-1)),
               ("f2p_last", "F2P", "binary_search([2, 4, 6, 8], 8)", V(3)),
               ("f2p_single", "F2P", "binary_search([4], 4)", V(0)),
               ("f2p_all", "F2P", "xs = list(range(0, 40, 3))\n"
                "result = [binary_search(xs, x) for x in xs]", V(list(range(14))))]),
    dict(
        id="pyfix-duration", module="duration.py", title="multi-digit durations are misparsed",
        issue="`parse_duration('90s')` returns 0 and `parse_duration('1h30m')` returns 3600; "
              "numbers in a duration can have several digits ('90s' is 90 seconds, '1h30m' 5400).",
        source='''"""Durations like 1h30m."""
import re

_UNITS = {"h": 3600, "m": 60, "s": 1}


def parse_duration(text):
    """Seconds in a duration such as '1h30m', '45s' or '2h5s'; ValueError on anything else."""
    if not re.fullmatch(r"(\\d+[hms])+", text):
        raise ValueError("bad duration: %r" % text)
    total = 0
    for number, unit in re.findall(r"(\\d)([hms])", text):
        total += int(number) * _UNITS[unit]
    return total
''',
        fix=[('re.findall(r"(\\d)([hms])", text)', 're.findall(r"(\\d+)([hms])", text)')],
        tests='''    def test_hours(self):
        self.assertEqual(parse_duration("1h"), 3600)

    def test_seconds(self):
        self.assertEqual(parse_duration("90s"), 90)
''',
        imports="from duration import parse_duration",
        cases=[("p2p_hour", "P2P", "parse_duration('1h')", V(3600)),
               ("p2p_mix", "P2P", "parse_duration('2h5s')", V(7205)),
               ("p2p_bad", "P2P", "parse_duration('abc')", R("ValueError")),
               ("p2p_empty", "P2P", "parse_duration('')", R("ValueError")),
               ("f2p_hm", "F2P", "parse_duration('1h30m')", V(5400)),
               ("f2p_minutes", "F2P", "parse_duration('12m')", V(720)),
               ("f2p_all", "F2P", "parse_duration('10h10m10s')", V(36610))]),
    dict(
        id="pyfix-lru", module="lru.py", title="LRU cache ignores reads when evicting",
        issue="After `put('a', 1)`, `put('b', 2)`, `get('a')`, `put('c', 3)` on a cache of capacity "
              "2, key 'a' is evicted, but 'a' was used more recently than 'b'; `get` must count as "
              "a use.",
        source='''"""A small LRU cache."""
from collections import OrderedDict


class LRUCache:
    """Fixed-capacity mapping that evicts the least recently used key (get and put both count)."""

    def __init__(self, capacity):
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._data = OrderedDict()

    def get(self, key, default=None):
        if key not in self._data:
            return default
        return self._data[key]

    def put(self, key, value):
        if key in self._data:
            self._data.move_to_end(key)
        self._data[key] = value
        if len(self._data) > self.capacity:
            self._data.popitem(last=False)

    def __len__(self):
        return len(self._data)
''',
        fix=[("            return default\n        return self._data[key]\n",
              "            return default\n        self._data.move_to_end(key)\n"
              "        return self._data[key]\n")],
        tests='''    def test_evicts_oldest(self):
        c = LRUCache(2)
        c.put("a", 1)
        c.put("b", 2)
        c.put("c", 3)
        self.assertIsNone(c.get("a"))

    def test_get_refreshes(self):
        c = LRUCache(2)
        c.put("a", 1)
        c.put("b", 2)
        c.get("a")
        c.put("c", 3)
        self.assertEqual(c.get("a"), 1)
''',
        imports="from lru import LRUCache",
        cases=[("p2p_evict", "P2P", "c = LRUCache(2)\nc.put('a', 1)\nc.put('b', 2)\nc.put('c', 3)\n"
                "result = [c.get('a'), c.get('b'), c.get('c'), len(c)]", V([None, 2, 3, 2])),
               ("p2p_update", "P2P", "c = LRUCache(1)\nc.put('a', 1)\nc.put('a', 2)\n"
                "result = [c.get('a'), len(c)]", V([2, 1])),
               ("p2p_zero", "P2P", "LRUCache(0)", R("ValueError")),
               ("f2p_get_refresh", "F2P", "c = LRUCache(2)\nc.put('x', 1)\nc.put('y', 2)\n"
                "c.get('x')\nc.put('z', 3)\nresult = [c.get('x'), c.get('y'), c.get('z')]",
                V([1, None, 3])),
               ("f2p_chain", "F2P", "c = LRUCache(3)\nfor k in 'abc':\n    c.put(k, k.upper())\n"
                "c.get('a')\nc.get('b')\nc.put('d', 'D')\nresult = [c.get(k) for k in 'abcd']",
                V(["A", "B", None, "D"]))]),  # the public API only: a fix may rename the storage
    dict(
        id="pyfix-snake", module="naming.py", title="camel_to_snake splits acronyms",
        issue="`camel_to_snake('parseHTTPResponse')` returns 'parse_h_t_t_p_response'; acronyms "
              "must stay together: 'parse_http_response', 'HTTPServer' -> 'http_server', "
              "'getID' -> 'get_id'.",
        source='''"""Identifier naming."""
import re


def camel_to_snake(name):
    """'parseHTTPResponse' -> 'parse_http_response'; acronyms stay together."""
    return re.sub(r"([A-Z])", r"_\\1", name).lower().lstrip("_")
''',
        fix=[('    return re.sub(r"([A-Z])", r"_\\1", name).lower().lstrip("_")\n',
              '    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\\1_\\2", name)\n'
              '    name = re.sub(r"([a-z0-9])([A-Z])", r"\\1_\\2", name)\n'
              '    return name.lower()\n')],
        tests='''    def test_simple(self):
        self.assertEqual(camel_to_snake("simpleTest"), "simple_test")

    def test_acronym(self):
        self.assertEqual(camel_to_snake("parseHTTPResponse"), "parse_http_response")
''',
        imports="from naming import camel_to_snake",
        cases=[("p2p_simple", "P2P", "camel_to_snake('simpleTest')", V("simple_test")),
               ("p2p_snake", "P2P", "camel_to_snake('already_snake')", V("already_snake")),
               ("p2p_digit", "P2P", "camel_to_snake('version2Beta')", V("version2_beta")),
               ("f2p_server", "F2P", "camel_to_snake('HTTPServer')", V("http_server")),
               ("f2p_get_id", "F2P", "camel_to_snake('getID')", V("get_id")),
               ("f2p_xml", "F2P", "camel_to_snake('loadXMLFileNow')", V("load_xml_file_now"))]),
    dict(
        id="pyfix-intervals", module="intervals.py", title="interval merge misses touching and unsorted input",
        issue="`merge_intervals([[1, 2], [2, 3]])` returns [[1, 2], [2, 3]] (touching intervals must "
              "merge into [[1, 3]]) and `merge_intervals([[5, 6], [1, 3], [2, 4]])` returns a "
              "wrong answer because the input is not sorted; the result must be sorted and disjoint.",
        source='''"""Interval helpers."""


def merge_intervals(intervals):
    """Merge overlapping or touching [start, end] intervals into a sorted, disjoint list of lists."""
    merged = []
    for start, end in intervals:
        if merged and start < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
''',
        fix=[("    for start, end in intervals:\n        if merged and start < merged[-1][1]:\n",
              "    for start, end in sorted(intervals):\n        if merged and start <= merged[-1][1]:\n")],
        tests='''    def test_overlap(self):
        self.assertEqual(merge_intervals([[1, 3], [2, 6], [8, 10]]), [[1, 6], [8, 10]])

    def test_touching(self):
        self.assertEqual(merge_intervals([[1, 2], [2, 3]]), [[1, 3]])
''',
        imports="from intervals import merge_intervals",
        cases=[("p2p_overlap", "P2P", "merge_intervals([[1, 3], [2, 6], [8, 10]])", V([[1, 6], [8, 10]])),
               ("p2p_empty", "P2P", "merge_intervals([])", V([])),
               ("p2p_inside", "P2P", "merge_intervals([[1, 5], [2, 3]])", V([[1, 5]])),
               ("p2p_tuples", "P2P", "merge_intervals([(1, 2), (4, 5)])", V([[1, 2], [4, 5]])),
               ("f2p_touch", "F2P", "merge_intervals([[0, 1], [1, 4], [4, 4]])", V([[0, 4]])),
               ("f2p_unsorted", "F2P", "merge_intervals([[5, 6], [1, 3], [2, 4]])", V([[1, 4], [5, 6]])),
               ("f2p_reverse", "F2P", "merge_intervals([[9, 12], [3, 4], [1, 2]])",
                V([[1, 2], [3, 4], [9, 12]]))]),
    dict(
        id="pyfix-rle", module="rle.py", title="run-length decode breaks on counts over 9",
        issue="`decode('12a')` returns 'aa' instead of twelve 'a's, so `decode(encode(s))` is wrong "
              "for runs longer than 9; counts may have several digits.",
        source='''"""Run-length encoding: 'aaab' <-> '3a1b'."""
import re


def encode(text):
    out = []
    i = 0
    while i < len(text):
        j = i
        while j < len(text) and text[j] == text[i]:
            j += 1
        out.append("%d%s" % (j - i, text[i]))
        i = j
    return "".join(out)


def decode(code):
    return "".join(ch * int(n) for n, ch in re.findall(r"(\\d)(\\D)", code))
''',
        fix=[('re.findall(r"(\\d)(\\D)", code)', 're.findall(r"(\\d+)(\\D)", code)')],
        tests='''    def test_roundtrip_short(self):
        self.assertEqual(decode(encode("aaab")), "aaab")

    def test_long_run(self):
        self.assertEqual(decode("12a"), "a" * 12)
''',
        imports="from rle import encode, decode",
        cases=[("p2p_encode", "P2P", "encode('aaab')", V("3a1b")),
               ("p2p_decode", "P2P", "decode('3a1b')", V("aaab")),
               ("p2p_empty", "P2P", "[encode(''), decode('')]", V(["", ""])),
               ("f2p_long", "F2P", "decode('15z2y')", V("z" * 15 + "yy")),
               ("f2p_roundtrip", "F2P", "s = 'x' * 23 + 'yz' + 'q' * 100\nresult = decode(encode(s))",
                V("x" * 23 + "yz" + "q" * 100))]),  # compared on the host, exact type: no always-equal object
    dict(
        id="pyfix-version", module="versions.py", title="version comparison is lexicographic",
        issue="`compare_versions('1.10', '1.9')` returns -1 but 1.10 is newer than 1.9; parts are "
              "numbers, and missing trailing parts count as 0 ('1.0' equals '1').",
        source='''"""Dotted version numbers."""


def compare_versions(a, b):
    """-1, 0 or 1 as version a is older than, equal to or newer than version b."""
    pa, pb = a.split("."), b.split(".")
    if pa < pb:
        return -1
    if pa > pb:
        return 1
    return 0
''',
        fix=[('    pa, pb = a.split("."), b.split(".")\n',
              '    pa = [int(x) for x in a.split(".")]\n    pb = [int(x) for x in b.split(".")]\n'
              '    n = max(len(pa), len(pb))\n    pa += [0] * (n - len(pa))\n'
              '    pb += [0] * (n - len(pb))\n')],
        tests='''    def test_simple(self):
        self.assertEqual(compare_versions("1.2", "1.3"), -1)

    def test_numeric(self):
        self.assertEqual(compare_versions("1.10", "1.9"), 1)
''',
        imports="from versions import compare_versions",
        cases=[("p2p_less", "P2P", "compare_versions('1.2', '1.3')", V(-1)),
               ("p2p_equal", "P2P", "compare_versions('1.2', '1.2')", V(0)),
               ("p2p_major", "P2P", "compare_versions('3', '2')", V(1)),
               ("f2p_numeric", "F2P", "compare_versions('2.10.1', '2.9.9')", V(1)),
               ("f2p_padding", "F2P", "[compare_versions('1.0', '1'), compare_versions('1', '1.0.0')]",
                V([0, 0])),
               ("f2p_long", "F2P", "compare_versions('2.0.0', '10.0')", V(-1))]),
]


def _pyfix_task(spec: dict) -> dict:
    module = spec["module"]
    stem = module[:-3]
    test = f"test_{stem}.py"
    fixed = spec["source"]
    for old, new in spec["fix"]:
        if fixed.count(old) != 1:
            raise ValueError(f"{spec['id']}: fix snippet must occur exactly once: {old!r}")
        fixed = fixed.replace(old, new)
    names = spec["imports"].split(" import ", 1)[1]
    tests = (f"import unittest\n\nfrom {stem} import {names}\n\n\n"
             f"class Test{stem.title().replace('_', '')}(unittest.TestCase):\n{spec['tests']}\n\n"
             "if __name__ == \"__main__\":\n    unittest.main()\n")
    checks = []
    for cid, label, expr, expect in spec["cases"]:
        body = expr if "\n" in expr or expr.startswith("result =") else f"result = {expr}"
        checks.append({"id": cid, "kind": "python", "label": label,
                       "code": f"{spec['imports']}\n{body}", "expect": expect})
    solution = [{"tool": "read", "path": module}, {"tool": "run", "command": "python3 -m unittest"}]
    solution += [{"tool": "edit", "path": module, "old": o, "new": n} for o, n in spec["fix"]]
    solution += [{"tool": "run", "command": "python3 -m unittest -v"},
                 {"tool": "finish", "summary": f"fixed {module}"}]
    return dict(id=spec["id"], family="pyfix", title=spec["title"],
                instruction=spec["issue"] + PYFIX_NOTE.format(module=module, test=test),
                workspace={module: spec["source"], test: tests}, checks=checks, solution=solution,
                fixed={module: fixed})


# ---------------------------------------------------------------------------------------------
# SQLite family

SCHEMA = """CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, email TEXT NOT NULL,
  country TEXT, created_at TEXT NOT NULL);
CREATE TABLE products (id INTEGER PRIMARY KEY, sku TEXT NOT NULL UNIQUE, name TEXT NOT NULL,
  category TEXT NOT NULL, price_cents INTEGER NOT NULL, stock INTEGER NOT NULL);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL, order_date TEXT NOT NULL,
  status TEXT);
CREATE TABLE order_items (id INTEGER PRIMARY KEY, order_id INTEGER NOT NULL,
  product_id INTEGER NOT NULL, quantity INTEGER NOT NULL, unit_price_cents INTEGER NOT NULL);
"""
TABLES = ["customers", "products", "orders", "order_items"]
FIRST = ["Ada", "Alan", "Grace", "Linus", "Barbara", "Dennis", "Ken", "Margaret", "Edsger", "Donald",
         "Frances", "John", "Radia", "Tim", "Shafi", "Leslie"]
LAST = ["Lovelace", "Turing", "Hopper", "Torvalds", "Liskov", "Ritchie", "Thompson", "Hamilton",
        "Dijkstra", "Knuth", "Allen", "Backus", "Perlman", "Berners", "Goldwasser", "Lamport"]
DOMAINS = ["example.com", "mail.test", "corp.example", "uni.example.org"]
COUNTRIES = ["US", "GB", "DE", "FR", "JP", "BR", "IN", "CA"]
CATEGORIES = ["books", "games", "tools", "garden"]


def _base_db(seed: int) -> dict:
    rng = random.Random(seed)
    customers, used = [], set()
    while len(customers) < 24:
        f, l = rng.choice(FIRST), rng.choice(LAST)
        if (f, l) in used:
            continue
        used.add((f, l))
        i = len(customers) + 1
        customers.append([i, f"{f} {l}", f"{f.lower()}.{l.lower()}@{rng.choice(DOMAINS)}",
                          rng.choice(COUNTRIES), f"202{rng.randint(2, 4)}-{rng.randint(1, 12):02d}-"
                          f"{rng.randint(1, 28):02d}"])
    products = []
    for i in range(1, 15):
        cat = CATEGORIES[(i - 1) % 4]
        products.append([i, f"SKU-{100 + i}", f"{cat[:-1].title()} item {i}", cat,
                         rng.randint(199, 9999), rng.randint(0, 50)])
    orders, items = [], []
    statuses = ["pending", "shipped", "delivered", "delivered", "delivered", "cancelled"]
    for i in range(1, 61):
        orders.append([i, rng.randint(1, 24), f"202{rng.randint(3, 4)}-{rng.randint(1, 12):02d}-"
                       f"{rng.randint(1, 28):02d}", rng.choice(statuses)])
        for _ in range(rng.randint(1, 3)):
            p = rng.choice(products)
            items.append([len(items) + 1, i, p[0], rng.randint(1, 5), p[4]])
    return {"customers": customers, "products": products, "orders": orders, "order_items": items}


def _sql_literal(v) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, (int, float)):
        return repr(v)
    return "'" + str(v).replace("'", "''") + "'"


def _render_db(db: dict) -> str:
    out = [SCHEMA]
    for t in TABLES:
        for row in db[t]:
            out.append(f"INSERT INTO {t} VALUES ({', '.join(_sql_literal(v) for v in row)});")
    return "\n".join(out) + "\n"


def _fix_script(sql: str | None = None, python: str | None = None) -> str:
    if python is None:
        python = f'conn.executescript("""{sql}""")\n'
    return ("import sqlite3\n\nconn = sqlite3.connect(\"app.db\")\n" + python
            + "conn.commit()\nconn.close()\n")


def _sqlite_specs() -> list[dict]:
    specs = []

    def add(id, title, instruction, mutate, fix, queries, extra_tables=(), extra_files=None, *, seed):
        db = _base_db(seed)
        specs.append(dict(id=id, title=title, instruction=instruction, db=db, mutate=mutate, fix=fix,
                          queries=queries, tables=TABLES + list(extra_tables),
                          extra_files=extra_files or {}))

    add("sqlite-archive-old", "archive old delivered orders",
        "Set the status of every order placed before 2024-01-01 whose status is 'delivered' to "
        "'archived'. Leave every other row unchanged.",
        None, _fix_script("UPDATE orders SET status = 'archived' WHERE order_date < '2024-01-01' "
                          "AND status = 'delivered';"),
        [("f2p_status", "F2P", "SELECT id, status FROM orders ORDER BY id"),
         ("p2p_orders", "P2P", "SELECT id, customer_id, order_date FROM orders ORDER BY id"),
         ("p2p_items", "P2P", "SELECT COUNT(*), SUM(quantity) FROM order_items")], seed=11)

    def dupes(db):
        rng = random.Random(5)
        for k, src in enumerate(rng.sample(db["customers"], 5)):
            new_id = 100 + k
            email = ("  " + src[2].upper()) if k % 2 else src[2].title()
            db["customers"].append([new_id, src[1], email, src[3], "2024-06-01"])
            for o in rng.sample(db["orders"], 2):
                o[1] = new_id
    add("sqlite-dedupe-customers", "merge duplicate customers",
        "Some customers were imported twice. Rows of the customers table whose email addresses are "
        "equal when compared case-insensitively and ignoring leading/trailing spaces are the same "
        "person. For each such group keep only the row with the smallest id, make every order of "
        "the group point to that id, and delete the other rows. Do not change the kept rows.",
        dupes, _fix_script("""
CREATE TEMP TABLE keep AS SELECT lower(trim(email)) AS e, MIN(id) AS id FROM customers
  GROUP BY lower(trim(email));
UPDATE orders SET customer_id = (SELECT k.id FROM keep k JOIN customers c ON lower(trim(c.email)) = k.e
  WHERE c.id = orders.customer_id);
DELETE FROM customers WHERE id NOT IN (SELECT id FROM keep);
"""),
        [("f2p_customers", "F2P", "SELECT id, name, email FROM customers ORDER BY id"),
         ("f2p_orders", "F2P", "SELECT id, customer_id FROM orders ORDER BY id"),
         ("p2p_items", "P2P", "SELECT id, order_id FROM order_items ORDER BY id")], seed=12)

    def upper_domains(db):
        for c in db["customers"][::3]:
            user, dom = c[2].split("@")
            c[2] = f"{user}@{dom.upper()}"
    add("sqlite-email-domain", "add an email_domain column",
        "Add a column named email_domain of type TEXT to the customers table and fill it, for every "
        "customer, with the part of the email address after the '@', lower-cased.",
        upper_domains, _fix_script("ALTER TABLE customers ADD COLUMN email_domain TEXT;\n"
                                   "UPDATE customers SET email_domain = "
                                   "lower(substr(email, instr(email, '@') + 1));"),
        [("f2p_domain", "F2P", "SELECT id, email_domain FROM customers ORDER BY id"),
         ("f2p_columns", "F2P", "SELECT name, type FROM pragma_table_info('customers') ORDER BY cid"),
         ("p2p_rows", "P2P", "SELECT id, name, email, country FROM customers ORDER BY id")], seed=13)

    def dollars(db):
        for p in db["products"]:
            if p[3] == "books":
                p[4] = p[4] // 100
        books = {p[0] for p in db["products"] if p[3] == "books"}
        for it in db["order_items"]:
            if it[2] in books:
                it[4] = it[4] // 100
    add("sqlite-fix-prices", "book prices entered in dollars",
        "Prices of products in the category 'books' were entered in dollars instead of cents "
        "(for example 12 instead of 1200). Multiply price_cents by 100 for those products, and "
        "unit_price_cents by 100 for the order items of those products. Nothing else may change.",
        dollars, _fix_script("""
UPDATE order_items SET unit_price_cents = unit_price_cents * 100
  WHERE product_id IN (SELECT id FROM products WHERE category = 'books');
UPDATE products SET price_cents = price_cents * 100 WHERE category = 'books';
"""),
        [("f2p_products", "F2P", "SELECT id, price_cents FROM products ORDER BY id"),
         ("f2p_items", "F2P", "SELECT id, unit_price_cents FROM order_items ORDER BY id"),
         ("p2p_stock", "P2P", "SELECT id, sku, stock FROM products ORDER BY id")], seed=14)

    add("sqlite-create-index", "index orders by customer and date",
        "Lookups of a customer's orders by date are slow. Create an index named "
        "idx_orders_customer_date on orders(customer_id, order_date), in that column order. "
        "Do not change any data.",
        None, _fix_script("CREATE INDEX idx_orders_customer_date ON orders(customer_id, order_date);"),
        [("f2p_index", "F2P", "SELECT name, tbl_name FROM sqlite_master WHERE type = 'index' "
                              "AND name = 'idx_orders_customer_date'"),
         ("f2p_columns", "F2P", "SELECT name FROM pragma_index_info('idx_orders_customer_date') "
                                "ORDER BY seqno"),
         ("p2p_orders", "P2P", "SELECT id, customer_id, order_date, status FROM orders ORDER BY id")],
        seed=15)

    add("sqlite-customer-totals", "build a customer_totals table",
        "Create a table customer_totals(customer_id INTEGER PRIMARY KEY, n_orders INTEGER NOT NULL, "
        "total_cents INTEGER NOT NULL) with one row per customer that has at least one order whose "
        "status is not 'cancelled'. n_orders counts those orders and total_cents is the sum of "
        "quantity * unit_price_cents over their order items.",
        None, _fix_script("""
CREATE TABLE customer_totals (customer_id INTEGER PRIMARY KEY, n_orders INTEGER NOT NULL,
  total_cents INTEGER NOT NULL);
INSERT INTO customer_totals SELECT o.customer_id, COUNT(DISTINCT o.id),
  SUM(i.quantity * i.unit_price_cents) FROM orders o JOIN order_items i ON i.order_id = o.id
  WHERE o.status != 'cancelled' GROUP BY o.customer_id;
"""),
        [("f2p_totals", "F2P", "SELECT customer_id, n_orders, total_cents FROM customer_totals "
                               "ORDER BY customer_id"),
         ("f2p_columns", "F2P", "SELECT name, type FROM pragma_table_info('customer_totals') "
                                "ORDER BY cid"),
         ("p2p_orders", "P2P", "SELECT COUNT(*) FROM orders")], extra_tables=["customer_totals"],
        seed=16)

    variants = {"US": ["USA", "U.S.", "United States", "us"], "GB": ["UK", "United Kingdom"],
                "DE": ["Germany", "Deutschland"]}

    def countries(db):
        rng = random.Random(7)
        for c in db["customers"]:
            if c[3] in variants and rng.random() < 0.8:
                c[3] = rng.choice(variants[c[3]])
    add("sqlite-normalize-country", "normalize country codes",
        "The country column of customers mixes ISO codes with other spellings. Replace 'USA', "
        "'U.S.', 'United States' and 'us' by 'US'; 'UK' and 'United Kingdom' by 'GB'; 'Germany' and "
        "'Deutschland' by 'DE'. Values that already are two-letter upper-case codes stay as they are.",
        countries, _fix_script("""
UPDATE customers SET country = CASE
  WHEN country IN ('USA', 'U.S.', 'United States', 'us') THEN 'US'
  WHEN country IN ('UK', 'United Kingdom') THEN 'GB'
  WHEN country IN ('Germany', 'Deutschland') THEN 'DE'
  ELSE country END;
"""),
        [("f2p_country", "F2P", "SELECT id, country FROM customers ORDER BY id"),
         ("p2p_names", "P2P", "SELECT id, name, email FROM customers ORDER BY id")], seed=17)

    def orphans(db):
        n = len(db["order_items"])
        db["order_items"] += [[n + 1, 999, 1, 1, 100], [n + 2, 3, 777, 2, 250],
                              [n + 3, 1000, 778, 1, 10], [n + 4, 998, 2, 4, 99]]
    add("sqlite-delete-orphans", "delete orphaned order items",
        "Delete every row of order_items that refers to an order that does not exist or to a "
        "product that does not exist. Keep all other rows.",
        orphans, _fix_script("DELETE FROM order_items WHERE order_id NOT IN (SELECT id FROM orders) "
                             "OR product_id NOT IN (SELECT id FROM products);"),
        [("f2p_items", "F2P", "SELECT id, order_id, product_id FROM order_items ORDER BY id"),
         ("p2p_orders", "P2P", "SELECT id, status FROM orders ORDER BY id")], seed=18)

    def spaces(db):
        rng = random.Random(9)
        for c in db["customers"]:
            if rng.random() < 0.6:
                c[1] = rng.choice(["  ", " ", "\t", " \t"]) + c[1] + rng.choice(["", " ", "  \t"])
    add("sqlite-trim-names", "strip whitespace around customer names",
        "Customer names have stray spaces and tab characters at the start and end. Remove all "
        "leading and trailing spaces and tabs from customers.name; do not change anything inside "
        "the names or any other column.",
        spaces, _fix_script("UPDATE customers SET name = trim(name, ' ' || char(9));"),
        [("f2p_names", "F2P", "SELECT id, name FROM customers ORDER BY id"),
         ("p2p_other", "P2P", "SELECT id, email, country, created_at FROM customers ORDER BY id")],
        seed=19)

    restock = "SKU-103,5\nSKU-110,12\nSKU-999,40\nSKU-103,1\nSKU-107,30\n"
    add("sqlite-restock", "apply a restock file",
        "The file restock.txt lists deliveries as lines 'SKU,QUANTITY'. Add each quantity to the "
        "stock of the product with that sku in app.db. A sku may appear on several lines; lines "
        "for skus that are not in the products table are ignored.",
        None, _fix_script(python="""for line in open("restock.txt"):
    sku, qty = line.strip().split(",")
    conn.execute("UPDATE products SET stock = stock + ? WHERE sku = ?", (int(qty), sku))
"""),
        [("f2p_stock", "F2P", "SELECT id, sku, stock FROM products ORDER BY id"),
         ("p2p_prices", "P2P", "SELECT id, price_cents FROM products ORDER BY id")],
        extra_files={"restock.txt": restock}, seed=20)

    def nulls(db):
        rng = random.Random(4)
        picked = rng.sample(db["orders"], 8)
        for o in picked:
            o[3] = None
        empty = {o[0] for o in picked[:3]}
        db["order_items"] = [it for it in db["order_items"] if it[1] not in empty]
    add("sqlite-null-status", "fill in missing order statuses",
        "Some orders have a NULL status. Set it to 'pending' for such orders that have at least "
        "one order item and to 'cancelled' for those that have none. Orders that have a status "
        "keep it.",
        nulls, _fix_script("""
UPDATE orders SET status = CASE WHEN EXISTS (SELECT 1 FROM order_items WHERE order_id = orders.id)
  THEN 'pending' ELSE 'cancelled' END WHERE status IS NULL;
"""),
        [("f2p_status", "F2P", "SELECT id, status FROM orders ORDER BY id"),
         ("p2p_items", "P2P", "SELECT COUNT(*) FROM order_items")], seed=21)
    return specs


SQLITE_NOTE = ("\n\nThe database is /workspace/app.db (SQLite). python3 with its sqlite3 module is "
               "available; the sqlite3 command-line tool may not be. The result is checked by "
               "querying the rows of app.db after you finish; tables must stay real tables.")


def _run_fix_on_host(db_bytes: bytes, script: str, extra_files: dict) -> sqlite3.Connection:
    with tempfile.TemporaryDirectory(prefix="k3-taskgen-") as d:
        Path(d, "app.db").write_bytes(db_bytes)
        for rel, text in extra_files.items():
            Path(d, rel).write_text(text)
        Path(d, "fix_db.py").write_text(script)
        subprocess.run([sys.executable, "-I", "fix_db.py"], cwd=d, check=True, timeout=60)
        mem = sqlite3.connect(":memory:")
        sqlite3.connect(Path(d, "app.db")).backup(mem)
    return mem


def _sqlite_task(spec: dict) -> dict:
    db = json.loads(json.dumps(spec["db"]))
    if spec["mutate"]:
        spec["mutate"](db)
    script = _render_db(db)
    original = sqlite3.connect(":memory:")
    original.executescript(script)
    conn = _run_fix_on_host(build_sqlite(script), spec["fix"], spec["extra_files"])
    checks = [{"id": "schema", "kind": "sql_schema", "label": "F2P" if len(spec["tables"]) > len(TABLES)
               else "P2P", "db": "app.db",
               "expect": {"tables": spec["tables"], "forbid": ["view", "trigger"]}}]
    for cid, label, sql in spec["queries"]:
        rows = [list(r) for r in conn.execute(sql).fetchall()]
        try:
            before = [list(r) for r in original.execute(sql).fetchall()]
        except sqlite3.Error:
            before = None
        if (before == rows) != (label == "P2P"):
            raise ValueError(f"{spec['id']}: check {cid} is labelled {label} but the untouched "
                             f"database {'passes' if before == rows else 'fails'} it")
        checks.append({"id": cid, "kind": "sql", "label": label, "db": "app.db", "sql": sql,
                       "expect": {"rows": rows}})
    solution = [{"tool": "run", "command": "python3 -c \"import sqlite3; print(sqlite3.connect('app.db')"
                                           ".execute('select name from sqlite_master').fetchall())\""},
                {"tool": "write", "path": "fix_db.py", "content": spec["fix"]},
                {"tool": "run", "command": "python3 fix_db.py && rm fix_db.py"},
                {"tool": "finish", "summary": "updated app.db"}]
    return dict(id=spec["id"], family="sqlite", title=spec["title"],
                instruction=spec["instruction"] + SQLITE_NOTE,
                workspace=dict(spec["extra_files"]), generate={"app.db": script}, checks=checks,
                solution=solution)


# ---------------------------------------------------------------------------------------------
# files / command-line family


def _sha(text: str | bytes) -> dict:
    data = text.encode() if isinstance(text, str) else text
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def _wc(name: str, text: str) -> str:
    data = text.encode()
    return f"{text.count(chr(10))} {len(text.split())} {len(data)} {name}"


def _files_specs() -> list[dict]:
    rng = random.Random(42)
    specs = []
    FILES_NOTE = ("\n\nWork in /workspace. Standard command-line tools (bash, coreutils, grep, sed, "
                  "awk, find) and python3 are available.")

    # 1 rename
    notes = {f"notes/{n}.txt": f"# {n}\n\n" + "".join(f"line {i} of {n}\n" for i in range(rng.randint(2, 6)))
             for n in ["alpha", "beta", "gamma", "todo list", "2024-plan"]}
    notes["notes/index.json"] = json.dumps({"notes": sorted(notes)}, indent=1) + "\n"
    want = {k[:-4] + ".md" if k.endswith(".txt") else k: v for k, v in notes.items()}
    checks = [{"id": "tree", "kind": "tree", "label": "F2P", "path": "notes",
               "expect": {"files": sorted(p[len("notes/"):] for p in want)}}]
    checks += [{"id": f"content_{i}", "kind": "file", "label": "F2P", "path": p, "expect": _sha(v)}
               for i, (p, v) in enumerate(sorted(want.items()))]
    specs.append(dict(id="files-rename-ext", title="rename .txt notes to .md",
                      instruction="Rename every file directly under notes/ whose name ends in .txt "
                      "so that it ends in .md instead (same base name, same content). Do not touch "
                      "other files." + FILES_NOTE,
                      workspace=notes, checks=checks,
                      solution=[{"tool": "run", "command": "ls -la notes"},
                                {"tool": "run", "command": "cd notes && for f in *.txt; do "
                                 "mv -- \"$f\" \"${f%.txt}.md\"; done"},
                                {"tool": "finish", "summary": "renamed"}]))

    # 2 unique sorted
    people = [rng.choice(FIRST) + " " + rng.choice(LAST) for _ in range(40)]
    people += ["ada lovelace", "Zed", "Émile Borel", "Ada Lovelace"]
    rng.shuffle(people)
    names = "\n".join(people) + "\n"
    uniq = "".join(n + "\n" for n in sorted(set(people), key=lambda s: s.encode()))
    specs.append(dict(id="files-unique-sorted", title="unique sorted names",
                      instruction="Write unique_names.txt containing the distinct lines of "
                      "names.txt sorted by byte value (as `LC_ALL=C sort -u` does), one per line, "
                      "each ending with a newline. names.txt must stay unchanged." + FILES_NOTE,
                      workspace={"names.txt": names},
                      checks=[{"id": "unique", "kind": "file", "label": "F2P",
                               "path": "unique_names.txt", "expect": _sha(uniq)},
                              {"id": "source", "kind": "file", "label": "P2P", "path": "names.txt",
                               "expect": _sha(names)}],
                      solution=[{"tool": "run", "command": "LC_ALL=C sort -u names.txt > unique_names.txt"},
                                {"tool": "finish", "summary": "done"}]))

    # 3 extract errors
    levels = ["INFO", "INFO", "DEBUG", "WARN", "ERROR"]
    lines = []
    for i in range(80):
        lvl = rng.choice(levels)
        msg = rng.choice(["user login", "cache miss", "ERROR count reset", "disk ok",
                          "request failed", "retrying", "no ERRORS found", "timeout"])
        lines.append(f"2024-05-{1 + i // 10:02d} 12:{i % 60:02d}:{rng.randint(0, 59):02d} {lvl} {msg}")
    log = "\n".join(lines) + "\n"
    errors = "".join(ln + "\n" for ln in lines if ln.split(" ")[2] == "ERROR")
    specs.append(dict(id="files-extract-errors", title="extract ERROR lines from a log",
                      instruction="logs/app.log.txt has lines 'DATE TIME LEVEL MESSAGE'. Write "
                      "errors.txt with exactly the lines whose LEVEL (the third space-separated "
                      "field) is ERROR, in their original order. Messages may contain the word "
                      "ERROR too; only the level counts." + FILES_NOTE,
                      workspace={"logs/app.log.txt": log},
                      checks=[{"id": "errors", "kind": "file", "label": "F2P", "path": "errors.txt",
                               "expect": _sha(errors)},
                              {"id": "log", "kind": "file", "label": "P2P", "path": "logs/app.log.txt",
                               "expect": _sha(log)}],
                      solution=[{"tool": "search", "pattern": " ERROR ", "path": "logs"},
                                {"tool": "run", "command": "awk '$3 == \"ERROR\"' logs/app.log.txt > errors.txt"},
                                {"tool": "finish", "summary": "done"}]))

    # 4 delete scratch files
    proj = {}
    for d in ["project", "project/src", "project/docs", "project/src/deep"]:
        for n in ["main", "util", "readme"]:
            proj[f"{d}/{n}.txt"] = f"{d} {n}\n"
        proj[f"{d}/scratch_{rng.randint(1, 99)}.txt"] = "temporary\n"
    proj["project/docs/not_scratch_notes.txt"] = "keep me\n"
    proj["project/src/scratch_pad.py"] = "print('tmp')\n"
    keep = {k: v for k, v in proj.items() if not k.rsplit("/", 1)[1].startswith("scratch_")}
    checks = [{"id": "tree", "kind": "tree", "label": "F2P", "path": "project",
               "expect": {"files": sorted(p[len("project/"):] for p in keep)}}]
    checks += [{"id": f"kept_{i}", "kind": "file", "label": "P2P", "path": p, "expect": _sha(v)}
               for i, (p, v) in enumerate(sorted(keep.items()))]
    specs.append(dict(id="files-delete-scratch", title="delete scratch files",
                      instruction="Delete every file anywhere under project/ whose name starts with "
                      "'scratch_', and nothing else." + FILES_NOTE,
                      workspace=proj, checks=checks,
                      solution=[{"tool": "run", "command": "find project -type f -name 'scratch_*' -print -delete"},
                                {"tool": "finish", "summary": "done"}]))

    # 5 csv -> json
    rows = [(rng.choice(FIRST), rng.randint(18, 90), rng.choice(["Paris", "Lagos", "Lima", "Osaka", "New York"]))
            for _ in range(12)]
    csv = "name,age,city\n" + "".join(f"{n},{a},{c}\n" for n, a, c in rows)
    specs.append(dict(id="files-csv-to-json", title="convert CSV to JSON",
                      instruction="data/people.txt is CSV with a header line name,age,city. Write "
                      "people.json: a JSON array with one object per data row, in file order, with "
                      "keys name (string), age (integer) and city (string). Formatting of the JSON "
                      "does not matter." + FILES_NOTE,
                      workspace={"data/people.txt": csv},
                      checks=[{"id": "json", "kind": "json_file", "label": "F2P", "path": "people.json",
                               "expect": {"value": [{"name": n, "age": a, "city": c} for n, a, c in rows]}}],
                      solution=[{"tool": "read", "path": "data/people.txt"},
                                {"tool": "write", "path": "to_json.py", "content":
                                 "import csv, json\nrows = list(csv.DictReader(open('data/people.txt')))\n"
                                 "for r in rows:\n    r['age'] = int(r['age'])\n"
                                 "json.dump(rows, open('people.json', 'w'), indent=2)\n"},
                                {"tool": "run", "command": "python3 to_json.py && cat people.json"},
                                {"tool": "finish", "summary": "done"}]))

    # 6 config edit
    cfg = {"name": "svc", "debug": True, "server": {"host": "0.0.0.0", "port": 8080, "workers": 4},
           "features": ["a", "b"], "timeout_s": 30.5}
    want = json.loads(json.dumps(cfg))
    want["debug"] = False
    want["server"]["port"] = 8081
    want["log_level"] = "info"
    specs.append(dict(id="files-config-edit", title="edit a JSON config",
                      instruction="In config.json set \"debug\" to false, set the port inside "
                      "\"server\" to 8081 and add a top-level key \"log_level\" with the value "
                      "\"info\". Keep every other key and value as it is." + FILES_NOTE,
                      workspace={"config.json": json.dumps(cfg, indent=2) + "\n"},
                      checks=[{"id": "json", "kind": "json_file", "label": "F2P", "path": "config.json",
                               "expect": {"value": want}}],
                      solution=[{"tool": "read", "path": "config.json"},
                                {"tool": "edit", "path": "config.json", "old": '"debug": true',
                                 "new": '"debug": false'},
                                {"tool": "edit", "path": "config.json", "old": '"port": 8080',
                                 "new": '"port": 8081'},
                                {"tool": "edit", "path": "config.json", "old": '"timeout_s": 30.5\n',
                                 "new": '"timeout_s": 30.5,\n  "log_level": "info"\n'},
                                {"tool": "run", "command": "python3 -m json.tool config.json"},
                                {"tool": "finish", "summary": "done"}]))

    # 7 wc script (command output on hidden inputs)
    hidden_a = "one two three\nfour\n\nfive six\n"
    hidden_b = "  spaced   out  words \nlast line without newline"
    example = "hello world\nsecond line\n"
    wc_script = ("import sys\n\ntotals = [0, 0, 0]\nfor name in sys.argv[1:]:\n"
                 "    data = open(name, 'rb').read()\n"
                 "    counts = [data.count(b'\\n'), len(data.split()), len(data)]\n"
                 "    totals = [t + c for t, c in zip(totals, counts)]\n"
                 "    print(*counts, name)\nif len(sys.argv) > 2:\n    print(*totals, 'total')\n")
    tot = [sum(x) for x in zip(*[(t.count("\n"), len(t.split()), len(t.encode())) for t in (hidden_a, hidden_b)])]
    specs.append(dict(id="files-wc-script", title="write a wc clone",
                      instruction="Write wc.py so that `python3 wc.py FILE...` prints, for each file "
                      "in order, a line '<lines> <words> <bytes> <name>' (lines = number of newline "
                      "characters, words = whitespace-separated words, name exactly as given, single "
                      "spaces), and when more than one file is given a final line "
                      "'<lines> <words> <bytes> total'. Try it on example.txt." + FILES_NOTE,
                      workspace={"example.txt": example},
                      checks=[{"id": "one_file", "kind": "command", "label": "F2P", "cwd": "inputs",
                               "argv": ["python3", "{workspace}/wc.py", "a.txt"],
                               "inputs": {"a.txt": hidden_a},
                               "expect": {"stdout": _wc("a.txt", hidden_a) + "\n"}},
                              {"id": "two_files", "kind": "command", "label": "F2P", "cwd": "inputs",
                               "argv": ["python3", "{workspace}/wc.py", "a.txt", "b.txt"],
                               "inputs": {"a.txt": hidden_a, "b.txt": hidden_b},
                               "expect": {"stdout": _wc("a.txt", hidden_a) + "\n"
                                          + _wc("b.txt", hidden_b) + "\n"
                                          + f"{tot[0]} {tot[1]} {tot[2]} total\n"}}],
                      solution=[{"tool": "write", "path": "wc.py", "content": wc_script},
                                {"tool": "run", "command": "python3 wc.py example.txt example.txt; wc example.txt"},
                                {"tool": "finish", "summary": "done"}]))

    # 8 sum a column from stdin
    def table(cols, n, seed):
        r = random.Random(seed)
        out = [",".join(cols)]
        total = 0
        for _ in range(n):
            vals = []
            for c in cols:
                if c == "amount":
                    cents = r.randint(-5000, 100000)
                    total += cents
                    vals.append(f"{cents / 100:.2f}")
                else:
                    vals.append(r.choice(["x", "y", "zz"]) + str(r.randint(1, 9)))
            out.append(",".join(vals))
        return "\n".join(out) + "\n", f"{total / 100:.2f}"
    t1, s1 = table(["id", "amount", "memo"], 25, 1)
    t2, s2 = table(["amount", "who"], 7, 2)
    t3, s3 = table(["who", "note", "amount"], 1, 3)
    ex, _ = table(["id", "amount"], 4, 4)
    total_py = ("import csv, sys\n\nrows = csv.DictReader(sys.stdin)\n"
                "cents = sum(round(float(r['amount']) * 100) for r in rows)\n"
                "print(f\"{cents / 100:.2f}\")\n")
    specs.append(dict(id="files-sum-column", title="sum a CSV column from stdin",
                      instruction="Write total.py that reads CSV with a header line from standard "
                      "input and prints the sum of the column named amount with exactly two "
                      "decimals (e.g. 12.50). The amount column can be at any position. Try it with "
                      "`python3 total.py < sample.txt`." + FILES_NOTE,
                      workspace={"sample.txt": ex},
                      checks=[{"id": f"sum_{i}", "kind": "command", "label": "F2P",
                               "argv": ["python3", "total.py"], "stdin": t, "expect": {"stdout": s + "\n"}}
                              for i, (t, s) in enumerate([(t1, s1), (t2, s2), (t3, s3)])],
                      solution=[{"tool": "write", "path": "total.py", "content": total_py},
                                {"tool": "run", "command": "python3 total.py < sample.txt"},
                                {"tool": "finish", "summary": "done"}]))

    # 9 executable greet script
    greet = "#!/bin/sh\necho \"Hello, ${1:-world}!\"\n"
    specs.append(dict(id="files-greet-exec", title="an executable greeting script",
                      instruction="Create an executable script bin/greet (with a #! line) so that "
                      "`./bin/greet NAME` prints 'Hello, NAME!' and `./bin/greet` with no argument "
                      "prints 'Hello, world!'." + FILES_NOTE,
                      workspace={"bin/README.txt": "Scripts live here.\n"},
                      checks=[{"id": "exec", "kind": "executable", "label": "F2P", "path": "bin/greet"},
                              {"id": "named", "kind": "command", "label": "F2P",
                               "argv": ["./bin/greet", "Grace Hopper"], "expect": {"stdout": "Hello, Grace Hopper!\n"}},
                              {"id": "default", "kind": "command", "label": "F2P",
                               "argv": ["./bin/greet"], "expect": {"stdout": "Hello, world!\n"}}],
                      solution=[{"tool": "write", "path": "bin/greet", "content": greet},
                                {"tool": "run", "command": "chmod +x bin/greet && ./bin/greet && ./bin/greet Ada"},
                                {"tool": "finish", "summary": "done"}]))

    # 10 replace a word across files
    docs = {}
    for i in range(4):
        words = rng.choices(["the", "colour", "Colour", "red", "is", "a", "colours", "shape",
                             "discolouration", "paint"], k=30)
        docs[f"docs/part{i}.txt"] = " ".join(words) + "\n"
    docs["docs/meta.json"] = json.dumps({"title": "colour guide"}) + "\n"
    want = {k: (v.replace("colour", "color").replace("Colour", "Color") if k.endswith(".txt") else v)
            for k, v in docs.items()}
    specs.append(dict(id="files-replace-word", title="American spelling in docs",
                      instruction="In every .txt file under docs/, replace each occurrence of "
                      "'colour' with 'color' and of 'Colour' with 'Color' (also inside longer words "
                      "such as 'colours'). Do not change other files." + FILES_NOTE,
                      workspace=docs,
                      checks=[{"id": f"doc_{i}", "kind": "file", "label": "F2P" if p.endswith(".txt") else "P2P",
                               "path": p, "expect": _sha(v)} for i, (p, v) in enumerate(sorted(want.items()))],
                      solution=[{"tool": "search", "pattern": "[Cc]olour", "path": "docs"},
                                {"tool": "run", "command": "sed -i 's/colour/color/g; s/Colour/Color/g' docs/*.txt"},
                                {"tool": "finish", "summary": "done"}]))

    # 11 organize by extension
    inbox = {"inbox/report.txt": "quarterly\n", "inbox/data.json": "{}\n", "inbox/tool.py": "print(1)\n",
             "inbox/notes.txt": "notes\n", "inbox/conf.json": "{\"a\": 1}\n", "inbox/setup.sql": "SELECT 1;\n"}
    want = {f"inbox/{p.rsplit('.', 1)[1]}/{p.split('/')[1]}": v for p, v in inbox.items()}
    checks = [{"id": "tree", "kind": "tree", "label": "F2P", "path": "inbox",
               "expect": {"files": sorted(p[len("inbox/"):] for p in want)}}]
    checks += [{"id": f"moved_{i}", "kind": "file", "label": "F2P", "path": p, "expect": _sha(v)}
               for i, (p, v) in enumerate(sorted(want.items()))]
    specs.append(dict(id="files-organize", title="sort files into folders by extension",
                      instruction="Move every file directly in inbox/ into a subdirectory of inbox/ "
                      "named after its extension without the dot (inbox/a.txt -> inbox/txt/a.txt). "
                      "Contents stay the same; no other files may remain directly in inbox/." + FILES_NOTE,
                      workspace=inbox, checks=checks,
                      solution=[{"tool": "run", "command": "cd inbox && for f in *.*; do e=\"${f##*.}\"; "
                                 "mkdir -p \"$e\" && mv -- \"$f\" \"$e/\"; done; find . -type f | sort"},
                                {"tool": "finish", "summary": "done"}]))
    for s in specs:
        s["family"] = "files"
        for c in s["checks"]:  # a file check is P2P exactly when the untouched workspace passes it
            if c["kind"] == "file":
                orig = s["workspace"].get(c["path"])
                c["label"] = "P2P" if orig is not None and _sha(orig) == c["expect"] else "F2P"
    return specs


def all_specs() -> list[dict]:
    return ([_pyfix_task(s) for s in PYFIX] + [_sqlite_task(s) for s in _sqlite_specs()]
            + _files_specs())


def _not_rebuilt(target: Path) -> str | None:
    """Why `target` is not a task directory that `build_all` wrote and may replace (None when it is):
    its task.json is a manifest for this id and it holds only the files that manifest lists."""
    if target.is_symlink() or not target.is_dir():
        return "is not a directory"
    try:
        m = loads_json((target / "task.json").read_text())  # a JSONDecodeError past absurd nesting
        ok = isinstance(m, dict) and m.get("format") == FORMAT and m.get("id") == target.name
        listed = ({"task.json"} | {f"workspace/{p}" for p in m["workspace"]["files"]} | set(m["hidden"])
                  if ok else set())
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        return "has no task.json written by `k3 agentenv tasks --rebuild`"
    extra = sorted(_listing(target) - listed)
    if extra:
        return f"holds files the task does not list ({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''})"
    return None


def build_all(out_dir: str | os.PathLike, force: bool = False) -> list[Path]:
    """Write every task under out_dir. An existing task directory is replaced only when rebuilding
    wrote it and it holds nothing else (checked for every task before anything is removed); `force`
    replaces it regardless."""
    import shutil
    base = Path(out_dir)
    if base.exists() and not base.is_dir():
        raise ValueError(f"--dir {out_dir} is a file, not a directory; pass a directory for the tasks")
    specs = all_specs()
    if not force:
        refused = []
        for spec in specs:
            target = base / spec["id"]
            why = _not_rebuilt(target) if target.exists() or target.is_symlink() else None
            if why:
                refused.append((target, why))
        if refused:
            target, why = refused[0]
            more = f" (and {len(refused) - 1} more task directories)" if len(refused) > 1 else ""
            raise ValueError(f"rebuilding would replace {target}, which {why}{more}; move your files out of it, "
                             "rebuild into another --dir, or add --force to replace it anyway")
    out = []
    for spec in specs:
        target = base / spec["id"]
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.exists():
            shutil.rmtree(target)
        out.append(write_task(out_dir, id=spec["id"], family=spec["family"], title=spec["title"],
                              instruction=spec["instruction"], workspace=spec["workspace"],
                              checks=spec["checks"], solution=spec["solution"],
                              generate=spec.get("generate")))
    return out
