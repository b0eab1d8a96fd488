import unittest

from inventory import add_item


class TestInventory(unittest.TestCase):
    def test_given_bucket(self):
        self.assertEqual(add_item(1, [0]), [0, 1])

    def test_fresh_default(self):
        add_item("x")
        self.assertEqual(add_item("y"), ["y"])


if __name__ == "__main__":
    unittest.main()
