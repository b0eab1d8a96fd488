import unittest

from textutils import slugify


class TestTextutils(unittest.TestCase):
    def test_simple(self):
        self.assertEqual(slugify("abc"), "abc")

    def test_punctuation(self):
        self.assertEqual(slugify("Hello, World!"), "hello-world")


if __name__ == "__main__":
    unittest.main()
