import unittest

from duration import parse_duration


class TestDuration(unittest.TestCase):
    def test_hours(self):
        self.assertEqual(parse_duration("1h"), 3600)

    def test_seconds(self):
        self.assertEqual(parse_duration("90s"), 90)


if __name__ == "__main__":
    unittest.main()
