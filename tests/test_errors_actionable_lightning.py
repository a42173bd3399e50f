"""A file_format="lazyckpt" Lightning checkpoint read by Lightning's own
loaders (``load_from_checkpoint``, a Trainer without the plugin): torch.load
reads lazyckpt's header as a legacy pickle and advises ``weights_only=False``,
which cannot help. Where lazyckpt's Lightning plugin class was imported, the
error names what does: the plugin, or ``lazyckpt.load``."""

from __future__ import annotations

import pickle

import pytest
import torch

import lazyckpt
from lazyckpt.errors import CheckpointError
from lazyckpt.integrations import lightning as lzl

from _frameworks import require  # noqa: E402

L = require("lightning.pytorch")


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def training_step(self, batch, _i):
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, _i):
        return None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader():
    data = torch.utils.data.TensorDataset(torch.randn(8, 4))
    return torch.utils.data.DataLoader(data, batch_size=4)


@pytest.fixture
def lazyckpt_ckpt(tmp_path):
    """A .ckpt written by the plugin in lazyckpt's own format, after a short fit."""
    trainer = L.Trainer(default_root_dir=tmp_path, max_steps=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu",
                        plugins=[lzl.LazyCheckpointIO(file_format="lazyckpt")],
                        callbacks=[L.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)])
    trainer.fit(Tiny(), _loader())
    path = str(tmp_path / "ckpt" / "last.ckpt")
    assert lazyckpt.load(path)["global_step"] == 2      # what the advice points to works
    return path


def _assert_says_what_to_do(info: pytest.ExceptionInfo) -> None:
    error = info.value
    assert isinstance(error, CheckpointError) and isinstance(error, pickle.UnpicklingError), repr(error)
    text = str(error)
    assert "lazyckpt file" in text and "plugins=[LazyCheckpointIO(" in text and "lazyckpt.load(" in text, text
    assert "file_format='torch'" in text, text


@pytest.mark.parametrize("weights_only", [None, False])
def test_load_from_checkpoint_of_a_lazyckpt_file_names_the_plugin(lazyckpt_ckpt, weights_only):
    with pytest.raises(CheckpointError) as info:
        Tiny.load_from_checkpoint(lazyckpt_ckpt, weights_only=weights_only)
    _assert_says_what_to_do(info)


def test_a_trainer_without_the_plugin_names_it(lazyckpt_ckpt, tmp_path):
    trainer = L.Trainer(default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu")
    with pytest.raises(CheckpointError) as info:
        trainer.validate(Tiny(), _loader(), ckpt_path=lazyckpt_ckpt)
    _assert_says_what_to_do(info)


def test_other_load_failures_are_left_as_they_were(tmp_path):
    """A file that is not lazyckpt's keeps torch's own error."""
    path = tmp_path / "junk.ckpt"
    path.write_bytes(b"not a checkpoint at all")
    with pytest.raises(Exception) as info:
        Tiny.load_from_checkpoint(str(path))
    assert not isinstance(info.value, CheckpointError)
