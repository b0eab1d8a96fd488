"""Run-length encoding: 'aaab' <-> '3a1b'."""
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
    return "".join(ch * int(n) for n, ch in re.findall(r"(\d)(\D)", code))
