import unittest

from wordcount import word_counts


class TestWordcount(unittest.TestCase):
    def test_simple(self):
        self.assertEqual(word_counts("a b a"), {"a": 2, "b": 1})

    def test_case(self):
        self.assertEqual(word_counts("The cat. the CAT!"), {"the": 2, "cat": 2})


if __name__ == "__main__":
    unittest.main()
