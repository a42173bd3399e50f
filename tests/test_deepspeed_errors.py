"""DeepSpeed's checkpoint engine (``lazyckpt.integrations.deepspeed``) with one
durable call failing while the process goes on: the crash-point harness's
error mode (tests/_crasherrors.py) on the DeepSpeed program
(tests/_crashdeepspeed.py), one call each, in tests/test_error_paths.py's
style: the error raised is the library's and names the cause; ``latest`` names
the tag the report says is committed, and that tag reads back whole; the same
engine's next save of the tag and a fresh process's restart work."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
from _frameworks import require  # noqa: E402

require("deepspeed")

import torch  # noqa: E402

from test_error_paths import fail_first  # noqa: E402

torch.set_num_threads(1)

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("after", [r"os\.replace \S+/step2/\.mp_rank_00_model_states\.pt\.tmp",
                                   r"os\.replace \S+/step2/\.zero_pp_rank_0_mp_rank_00_optim_states\.pt\.tmp"],
                         ids=["model-states", "optim-states"])
def test_a_failed_directory_fsync_after_a_deepspeed_part_file_fails_the_tag(tmp_path, after):
    """A part file of tag step2 is renamed into place, then its directory's fsync
    fails (EIO): the file's entry may not survive a power loss, so the tag is
    not committed: ``wait`` raises, ``latest`` keeps naming step1, and saving
    step2 again with the same engine commits it."""
    from _crashdeepspeed import deepspeed_program
    result = fail_first(deepspeed_program(), r"os\.fsync (dry|case-error-\d+)/ds/step2( |$)", tmp_path,
                        after=after)
    assert result["raised"], result
    assert not result["problems"], result["problems"]


def test_a_failed_directory_fsync_after_deepspeed_latest_keeps_the_previous_tag(tmp_path):
    """Every part file of tag step2 is durable; ``latest`` is renamed over, now
    naming step2, then the directory's fsync fails (EIO). ``wait`` raises (the
    new ``latest`` may be taken back by a power loss). Before the fix ``latest``
    stayed naming step2: the save reported failed was the one DeepSpeed's
    ``load_checkpoint`` resumed from. ``latest`` is put back to step1."""
    from _crashdeepspeed import deepspeed_program
    result = fail_first(deepspeed_program(), r"os\.fsync (dry|case-error-\d+)/ds( |$)", tmp_path,
                        after=r"os\.replace \S+/ds/latest\.tmp")
    assert result["raised"], result
    assert not result["problems"], result["problems"]
