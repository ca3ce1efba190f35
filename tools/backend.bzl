"""llmq_backend: the Bazel targets of one backend package under backends/<name>/."""

load("//tools:pytest.bzl", "llmq_py_test")

def llmq_backend(name, deps = [], tests = {}):
    """Declares, in backends/<name>/:

    - py_library `name` over llmq_<name>/**/*.py (imported as `llmq_<name>`), visible above the
      core only, depending on the Backend protocol (//python/llmq:backend), the quantized tensors
      and checkpoint I/O it writes with (//python/llmq/quant, //python/llmq/checkpoint) and `deps`;
    - where <name>_testutil.py exists, py_library `<name>_testutil` (testonly) from it;
    - one llmq_py_test per entry of `tests`: {test name: {"backend": runtime gate or None,
      "size": "small" by default, "deps": extra deps}}, each depending on the library (and testutil).
    """
    native.py_library(
        name = name,
        srcs = native.glob(["llmq_%s/**/*.py" % name]),
        imports = ["."],
        visibility = ["//tools:above_core"],
        deps = ["//python/llmq:backend", "//python/llmq/checkpoint", "//python/llmq/quant"] + deps,
    )
    test_deps = [":" + name]
    if native.glob([name + "_testutil.py"]):
        native.py_library(
            name = name + "_testutil",
            testonly = True,
            srcs = [name + "_testutil.py"],
            imports = ["."],
            deps = ["//python/llmq/quant"],
        )
        test_deps.append(":%s_testutil" % name)
    for test, attrs in tests.items():
        llmq_py_test(
            name = test,
            size = attrs.get("size", "small"),
            backend = attrs.get("backend"),
            deps = test_deps + attrs.get("deps", []),
        )
