"""Studying a run from its checkpoints: ``diff`` two committed steps, follow a
statistic of each tensor over every kept step (``trajectory``).

Both read pieces of tensors, never whole states:

* A tensor is a list of *pieces*: boxes of its global shape, each a strided
  view into one entry of one data file (a plain tensor is one piece at the
  origin; a DTensor saved by FSDP2 / tensor parallel is one piece per saved
  shard, found through the step's shard index, replicas counted once). So a
  step of 2 ranks compares with a step of 1 or 4 by global region, no tensor
  is ever assembled.
* Each box (the intersection of a piece of A with a piece of B, for a diff)
  is cut into sub-boxes whose bytes span at most ``chunk_bytes`` in each
  piece's storage; one sub-box is read at a time (whole checksum blocks
  around it, each verified, as every read of the library), its statistics
  folded into float64 accumulators (a trajectory folds only the statistic
  asked for), and the buffer dropped. Memory per worker: the checksum blocks
  around one sub-box per side (about two chunks per side) plus float64
  slices of 256 Ki elements, whatever the model.
* Bytes already identical by construction are not read: where both sides of
  a region name the same bytes (an incremental step's ``"ref"`` entry to the
  other step's data, or both to a third step's, the same save of the same
  run) with the same geometry, the region is unchanged. A tensor whose every
  region is such is reported unchanged with zero bytes read; in a
  ``trajectory`` its statistic is computed once and reused for every step
  that refers to the same bytes. (A tensor only partly referenced reads its
  referenced regions once, on the A side, for ``||a||`` and the cosine.)

What is compared: tensors (``torch.Tensor`` and DTensor leaves). Pickled
objects, numpy arrays, ``bytes``, meta and complex tensors get a row that says
why they were skipped, never a silent gap; Python values (scalars, strings)
are counted in ``values_not_compared``. Keys or shapes that disagree give a
skipped row naming both sides. Everything is resolved from the footers
before the first byte of data is read, so a missing or damaged step fails
the whole call (``CheckpointNotFoundError`` / ``CorruptCheckpointError``)
instead of returning a partial answer.

A step is named by a path as ``lazyckpt inspect`` takes it (a ``.lzc`` file,
a step directory, a Checkpointer directory: its latest step; local or
``s3://``), or ``RUN@STEP`` for a given committed step of a run.

Where the code is (each module says more):

* ``pieces.py``: a step opened as pieces (``StepView``, ``TensorInfo``,
  ``Piece``), boxes cut to a chunk and read verified (``boxes``,
  ``BoxReader``, ``ReadCounter``), key globs;
* ``diffs.py``: ``diff`` -> ``DiffReport`` of ``DiffRow``;
* ``trajectories.py``: ``trajectory`` -> ``Trajectory``, ``run_steps``
  (a run's kept steps on both tiers), the per-statistic accumulators;
* ``panels.py``: what a plot of a run shows (a panel per group, counters
  left out, log axes, line styles, the metrics of the saves' metadata), for
  ``trajectory --png`` and the report page;
* ``report.py``: ``write_report`` / ``collect`` -> ``RunReport``, the page of
  ``lazyckpt report`` (the index and a sample of manifests, not every step);
* ``cli/study.py``: ``lazyckpt diff``, ``lazyckpt trajectory`` and ``lazyckpt report``.

This module is the public face: import from here. The submodules are
``diffs`` and ``trajectories``, not ``diff`` and ``trajectory``: a submodule
named like the function this package exports would rebind
``lazyckpt.study.diff`` to the module the first time it is imported.
"""

from __future__ import annotations

from .diffs import DiffReport, DiffRow, diff
from .pieces import ReadCounter, StepView, TensorInfo
from .report import RunReport, collect, write_report
from .trajectories import STATS, Trajectory, run_steps, trajectory

__all__ = ["diff", "trajectory", "run_steps", "write_report", "collect", "DiffReport", "DiffRow", "Trajectory",
           "RunReport", "ReadCounter", "StepView", "TensorInfo", "STATS"]
