import unittest

from search import binary_search


class TestSearch(unittest.TestCase):
    def test_middle(self):
        self.assertEqual(binary_search([1, 3, 5, 7, 9], 5), 2)

    def test_last(self):
        self.assertEqual(binary_search([1, 3, 5, 7, 9], 9), 4)


if __name__ == "__main__":
    unittest.main()
