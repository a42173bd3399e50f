"""pytest plugin for scripts/run_lightning_suite.sh: every lightning.pytorch
Trainer built without a CheckpointIO plugin gets lazyckpt's LazyCheckpointIO
(LAZYCKPT_SWAP=torch|lazyckpt picks its file format; unset: no swap, the
baseline run). The plugin's saves are counted and printed at the end, which
proves the swap took effect."""

import os


SWAP = os.environ.get("LAZYCKPT_SWAP", "")
_saves = {"plugin_saves": 0, "trainers_swapped": 0}


def pytest_configure(config):
    if not SWAP:
        return
    import lightning.pytorch as L
    from lightning.fabric.plugins import CheckpointIO
    from lazyckpt.integrations.lightning import LazyCheckpointIO

    original_init = L.Trainer.__init__
    original_save = LazyCheckpointIO.save_checkpoint

    def counted_save(self, *args, **kwargs):
        _saves["plugin_saves"] += 1
        return original_save(self, *args, **kwargs)

    def init(self, *args, **kwargs):
        plugins = kwargs.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        strategy = kwargs.get("strategy")
        if not any(isinstance(p, CheckpointIO) for p in plugins) and \
                getattr(strategy, "_checkpoint_io", None) is None:
            plugins.append(LazyCheckpointIO(file_format=SWAP))
            kwargs["plugins"] = plugins
            _saves["trainers_swapped"] += 1
        original_init(self, *args, **kwargs)

    LazyCheckpointIO.save_checkpoint = counted_save
    L.Trainer.__init__ = init


def pytest_terminal_summary(terminalreporter):
    if SWAP:
        terminalreporter.write_line(f"lazyckpt swap ({SWAP}): {_saves}")
