import unittest

from rle import encode, decode


class TestRle(unittest.TestCase):
    def test_roundtrip_short(self):
        self.assertEqual(decode(encode("aaab")), "aaab")

    def test_long_run(self):
        self.assertEqual(decode("12a"), "a" * 12)


if __name__ == "__main__":
    unittest.main()
