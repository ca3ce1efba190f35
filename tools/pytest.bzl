"""llmq_py_test: one Bazel test target per pytest file, gated by backend.

The test runs pytest on its file (`srcs`, by default `<name>.py`) (so a failure prints pytest's own report) through
//tools:pytest_runner.py. `backend = "cuda"`, `"mlx"` or `"executorch"` makes the target incompatible,
hence SKIPPED by `bazel test //...`, on machines without that runtime.
"""

_BACKEND_CONSTRAINTS = {
    "cuda": "@llmq_platform//:cuda_present",
    "mlx": "@llmq_platform//:mlx_present",
    "executorch": "@llmq_platform//:executorch_present",
}

def llmq_py_test(name, srcs = None, deps = [], data = [], backend = None, args = [], tags = [], env = {}, **kwargs):
    if srcs == None:
        srcs = [name + ".py"]
    if len(srcs) != 1:
        fail("llmq_py_test %s: give exactly one test file in srcs (got %s)" % (name, srcs))
    compat = []
    if backend != None:
        if backend not in _BACKEND_CONSTRAINTS:
            fail("llmq_py_test %s: unknown backend %r; expected one of %s" % (name, backend, _BACKEND_CONSTRAINTS.keys()))
        compat = [_BACKEND_CONSTRAINTS[backend]]
        tags = tags + ["backend-" + backend]
    runner = "//tools:pytest_runner.py"
    native.py_test(
        name = name,
        srcs = srcs + [runner],
        main = runner,
        args = ["$(location %s)" % srcs[0]] + args,
        deps = deps,
        data = data,
        python_version = "PY3",
        target_compatible_with = compat,
        tags = tags,
        env = dict({"PYTHONDONTWRITEBYTECODE": "1"}, **env),
        **kwargs
    )
