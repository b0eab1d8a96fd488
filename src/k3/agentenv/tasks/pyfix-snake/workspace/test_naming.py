import unittest

from naming import camel_to_snake


class TestNaming(unittest.TestCase):
    def test_simple(self):
        self.assertEqual(camel_to_snake("simpleTest"), "simple_test")

    def test_acronym(self):
        self.assertEqual(camel_to_snake("parseHTTPResponse"), "parse_http_response")


if __name__ == "__main__":
    unittest.main()
