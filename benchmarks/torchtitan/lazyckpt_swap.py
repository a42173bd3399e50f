"""pytest plugin (``-p lazyckpt_swap``): torchtitan's CheckpointManager is
lazyckpt's LazyCheckpointManager wherever torchtitan's tests import it from,
before they import it. Used by run_suite.sh."""
import torchtitan.components.checkpoint as legacy
import torchtitan.components.checkpointer as package
import torchtitan.components.checkpointer.dcp as dcp_module

from lazyckpt.integrations.torchtitan import LazyCheckpointManager

for module in (legacy, package, dcp_module):
    module.CheckpointManager = LazyCheckpointManager
