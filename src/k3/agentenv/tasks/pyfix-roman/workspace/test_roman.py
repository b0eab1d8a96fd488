import unittest

from roman import to_roman


class TestRoman(unittest.TestCase):
    def test_small(self):
        self.assertEqual(to_roman(3), "III")

    def test_four(self):
        self.assertEqual(to_roman(4), "IV")


if __name__ == "__main__":
    unittest.main()
