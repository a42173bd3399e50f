"""Issue 35 (6): an integration refuses, with the reason, every option it would
accept and then ignore, and passes the ones it uses on to its writer."""

from __future__ import annotations

import pytest

from lazyckpt import Persist
from lazyckpt.integrations._async import WHOLE_FILE_REFUSED, tier_options
from lazyckpt.options import LazyckptDeprecationWarning
from lazyckpt.integrations.dcp import DCP_REFUSED, LazyStorageWriter

IGNORED_BY_FILE_WRITERS = [("incremental", True), ("incremental", "version-counters"), ("full_every", 4),
                           ("storage_options", {"endpoint_url": "http://127.0.0.1:1"}),
                           ("persist_bandwidth", 1e6), ("advise_mtbf", "8h"), ("persist_to", "s3://bkt/run"),
                           ("keep_last", 3), ("replicas", 1), ("replicated", ["model"])]


def _lightning_plugins():
    plugins = []
    try:
        from lazyckpt.integrations.lightning import LazyCheckpointIO
        plugins.append(LazyCheckpointIO)
    except ImportError:
        pass
    try:
        from lazyckpt.integrations.lightning import PLLazyCheckpointIO
        plugins.append(PLLazyCheckpointIO)
    except ImportError:
        pass
    if not plugins:
        pytest.skip("neither lightning nor pytorch_lightning is installed (extras 'lightning')")
    return plugins


@pytest.mark.parametrize("name,value", [(n, v) for n, v in IGNORED_BY_FILE_WRITERS
                                        if n not in ("storage_options", "persist_to")],
                         ids=lambda v: str(v)[:20])
def test_lightning_refuses_what_it_would_ignore_and_says_why(name, value):
    """storage_options (an s3:// dirpath) and persist_to are Lightning's now
    (tests/test_lightning_s3.py); persist_bandwidth without persist_to is still refused."""
    for plugin in _lightning_plugins():
        with pytest.raises(ValueError) as caught:
            plugin(**{name: value})
        message = str(caught.value)
        assert message.startswith(f"{plugin.__name__}: {name}=") and WHOLE_FILE_REFUSED[name] in message


@pytest.mark.parametrize("name,value", [(n, v) for n, v in IGNORED_BY_FILE_WRITERS if n != "storage_options"],
                         ids=lambda v: str(v)[:20])
def test_dcp_refuses_what_it_would_ignore_and_says_why(tmp_path, name, value):
    with pytest.raises(ValueError) as caught:
        LazyStorageWriter(tmp_path, **{name: value})
    assert str(caught.value).startswith(f"LazyStorageWriter: {name}=") and DCP_REFUSED[name] in str(caught.value)


def test_what_asks_for_nothing_passes_and_what_is_used_reaches_the_writer(tmp_path):
    for plugin in _lightning_plugins():
        io = plugin(incremental=False, full_every=0, persist_bandwidth=0, keep_last=None,
                    writer_threads=2, chunk_bytes=1 << 20,
                    storage_options={"endpoint_url": "http://127.0.0.1:1"})     # dirpath="s3://..." uses it
        assert (io.writer.options.writer_threads, io.writer.options.chunk_bytes) == (2, 1 << 20)
        assert dict(io.writer.options.storage_options)
        io.writer.close()
        with pytest.raises(TypeError, match="unknown options"):
            plugin(writer_thread=2)                              # a typo is still a typo
    writer = LazyStorageWriter(tmp_path, incremental="off", writer_threads=3,
                               storage_options={"endpoint_url": "http://127.0.0.1:1"})
    assert writer.options.writer_threads == 3 and dict(writer.options.storage_options)
    with pytest.raises(TypeError, match="unknown options"):
        LazyStorageWriter(tmp_path, writer_thread=2)


@pytest.mark.parametrize("name,value", IGNORED_BY_FILE_WRITERS, ids=lambda v: str(v)[:20])
def test_the_hf_trainer_refuses_what_it_would_ignore_and_says_why(tmp_path, name, value):
    transformers = pytest.importorskip("transformers", reason="transformers not installed (extra 'hf')")
    from lazyckpt.integrations import huggingface as lzhf
    config = transformers.LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=32, vocab_size=64, max_position_embeddings=16)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
    with pytest.raises(ValueError) as caught:
        lzhf.LazyCheckpointTrainer(model=transformers.LlamaForCausalLM(config), args=args,
                                   lazyckpt_options={name: value})
    assert str(caught.value).startswith(f"lazyckpt_options: {name}=") and WHOLE_FILE_REFUSED[name] in str(caught.value)


# ---------------------------------------------------------------------- the persistent tier's spellings

def _hf_trainer(tmp_path, **kw):
    transformers = pytest.importorskip("transformers", reason="transformers not installed (extra 'hf')")
    from lazyckpt.integrations import huggingface as lzhf
    config = transformers.LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=32, vocab_size=64, max_position_embeddings=16)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
    return lzhf.LazyCheckpointTrainer(model=transformers.LlamaForCausalLM(config), args=args, **kw)


STORE = {"endpoint_url": "http://127.0.0.1:1"}


def test_lightning_takes_the_persistent_tier_as_persist():
    for plugin in _lightning_plugins():
        io = plugin(persist="s3://bkt/run")
        assert io.persist == Persist("s3://bkt/run") and io.persist_to == "s3://bkt/run"
        tier = Persist("s3://bkt/run", bandwidth="2MB", storage_options=STORE)
        io = plugin(persist=tier, storage_options={"endpoint_url": "http://127.0.0.1:2"})
        assert io.persist is tier
        # The uploads take the tier's cap and store settings; the s3:// checkpoint paths the plugin's.
        options = tier_options(io.options, io.persist)
        assert options.persist_bandwidth == 2e6 and dict(options.storage_options) == STORE
        assert dict(io.options.storage_options) == {"endpoint_url": "http://127.0.0.1:2"}


def test_lightning_old_persist_spellings_work_and_warn_naming_the_new_one():
    for plugin in _lightning_plugins():
        with pytest.warns(DeprecationWarning) as caught:
            io = plugin(persist_to="s3://bkt/run", persist_bandwidth=1e6)
        messages = [str(w.message) for w in caught]
        assert any(m.startswith("persist_to='s3://bkt/run' is deprecated: use persist='s3://bkt/run'") for m in messages)
        assert any("persist_bandwidth=1000000.0 is deprecated here: use lazyckpt.Persist(url, bandwidth="
                   in m for m in messages)
        assert all(issubclass(w.category, LazyckptDeprecationWarning) for w in caught)
        assert io.persist == Persist("s3://bkt/run", bandwidth=10 ** 6) and io.persist_to == "s3://bkt/run"
        assert tier_options(io.options, io.persist).persist_bandwidth == 1e6


def test_the_persistent_tier_refuses_what_cannot_apply():
    for plugin in _lightning_plugins():
        with pytest.raises(TypeError, match="persist_to= and persist= were both given"):
            plugin(persist="s3://bkt/run", persist_to="s3://bkt/other")
        with pytest.raises(ValueError, match=r"Persist\(keep=...\) is not supported: the persistent tier mirrors"):
            plugin(persist=Persist("s3://bkt/run", keep=2))
        with pytest.raises(ValueError, match="expected an object store URL"):
            plugin(persist="/tmp/elsewhere")
        with pytest.raises(TypeError, match=r"persist must be an object store URL or lazyckpt.Persist"):
            plugin(persist=3)
        with pytest.raises(TypeError, match=r"persist_bandwidth= and lazyckpt.Persist\(bandwidth=...\) were both"):
            plugin(persist=Persist("s3://bkt/run", bandwidth=5), persist_bandwidth=6)


def test_the_hf_trainer_takes_the_persistent_tier_as_lazyckpt_persist(tmp_path):
    tier = Persist("s3://bkt/run", bandwidth=10 ** 6, storage_options=STORE)
    trainer = _hf_trainer(tmp_path, lazyckpt_persist=tier)
    assert trainer.lazyckpt_persist is tier and trainer.lazyckpt_persist_to == "s3://bkt/run"
    options = tier_options(trainer.lazyckpt_writer.options, tier)
    assert options.persist_bandwidth == 1e6 and dict(options.storage_options) == STORE
    trainer.lazyckpt_close()
    assert _hf_trainer(tmp_path, lazyckpt_persist="s3://bkt/run").lazyckpt_persist == Persist("s3://bkt/run")


def test_the_hf_trainer_old_persist_spellings_work_and_warn_naming_the_new_one(tmp_path):
    with pytest.warns(LazyckptDeprecationWarning) as caught:
        trainer = _hf_trainer(tmp_path, lazyckpt_persist_to="s3://bkt/run",
                              lazyckpt_options={"storage_options": STORE, "persist_bandwidth": 1e6})
    messages = [str(w.message) for w in caught]
    assert any(m.startswith("lazyckpt_persist_to='s3://bkt/run' is deprecated: use lazyckpt_persist='s3://bkt/run'")
               for m in messages)
    assert any(m.startswith("storage_options={...} is deprecated here: use lazyckpt.Persist(url, storage_options=")
               for m in messages)
    assert any(m.startswith("persist_bandwidth=1000000.0 is deprecated here") for m in messages)
    assert trainer.lazyckpt_persist == Persist("s3://bkt/run", bandwidth=10 ** 6, storage_options=STORE)
    trainer.lazyckpt_close()
    with pytest.raises(TypeError, match="lazyckpt_persist_to= and lazyckpt_persist= were both given"):
        _hf_trainer(tmp_path, lazyckpt_persist="s3://bkt/run", lazyckpt_persist_to="s3://bkt/run")
