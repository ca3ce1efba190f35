"""external_import_shim(): the root __init__.py, only when llmq is another workspace's dependency.

In llmq's own workspace the target is empty (its tests import python/llmq directly, and a
package file at the repository root would change how pytest names test modules).
"""

def external_import_shim(name):
    native.py_library(
        name = name,
        srcs = ["__init__.py"] if native.repository_name() != "@" else [],
        visibility = ["//python/llmq:__pkg__"],
    )
