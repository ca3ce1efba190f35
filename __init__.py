"""`import llmq` from another Bazel workspace: this file is the real python/llmq package's stand-in.

With llmq as an external repository named `llmq`, the runfiles tree holds `<runfiles>/llmq/`
(this repository) ahead of `<runfiles>/llmq/python/` on sys.path, and Bazel's
legacy_create_init would make that folder an empty package named `llmq`. This file, shipped
only to other workspaces (//:external_import_shim), replaces itself in sys.modules with
python/llmq loaded under the name `llmq`, so `import llmq.quant` and friends work unchanged.
"""

import importlib.util as _util
import os as _os
import sys as _sys

_package_dir = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "python", "llmq")
_spec = _util.spec_from_file_location(
    __name__,
    _os.path.join(_package_dir, "__init__.py"),
    submodule_search_locations=[_package_dir],
)
_module = _util.module_from_spec(_spec)
_sys.modules[__name__] = _module
_spec.loader.exec_module(_module)
