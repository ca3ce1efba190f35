"""quantize_and_save: read -> recipe -> quantize -> write (backend) -> summary, then reload and check.

The pipeline's modules, one job each: inputs.py (HF folder, GGUF file, embedded default), run.py
(the job), verify.py (reload and compare), cli.py (flags, --help, main_for). This module keeps
their names importable from one place.
"""

from models.pipeline.cli import cli_wording, list_recipes, main_for, parse_flags_or_exit  # noqa: F401
from models.pipeline.inputs import model_tensors, read_hf_config  # noqa: F401
from models.pipeline.run import _user_path, run  # noqa: F401
from models.pipeline.usage_error import UsageError  # noqa: F401

_read_hf_config = read_hf_config  # the name export_pt2 and tests use
