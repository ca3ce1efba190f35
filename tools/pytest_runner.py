"""Entry point of every llmq_py_test: runs pytest on the one file Bazel passes in.

Bazel runs tests in a read-only runfiles tree, so pytest's cache is off, and exit code 5
(no tests collected) is an error: a test target that tests nothing must fail.
"""

import os
import sys

import pytest


def main(argv):
    if len(argv) < 2:
        sys.exit("pytest_runner: expected the test file as the first argument")
    test_file, extra = argv[1], argv[2:]
    args = [test_file, "-p", "no:cacheprovider", "-q", "-rs", "--color=no"]
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        args.append("--junitxml=" + xml)
    test_filter = os.environ.get("TESTBRIDGE_TEST_ONLY")
    if test_filter:
        args += ["-k", test_filter]
    return pytest.main(args + extra)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
