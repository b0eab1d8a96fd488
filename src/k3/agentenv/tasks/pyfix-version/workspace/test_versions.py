import unittest

from versions import compare_versions


class TestVersions(unittest.TestCase):
    def test_simple(self):
        self.assertEqual(compare_versions("1.2", "1.3"), -1)

    def test_numeric(self):
        self.assertEqual(compare_versions("1.10", "1.9"), 1)


if __name__ == "__main__":
    unittest.main()
