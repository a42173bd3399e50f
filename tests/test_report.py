"""``lazyckpt trajectory --png`` that shows what changed, and ``lazyckpt
report``'s page (lazyckpt/study/panels.py, lazyckpt/study/report.py), on real
runs: the MLP + AdamW run a new user tries first (60 steps, a save every 5
with the loss in ``metadata=``), a rollback, incremental saves, an object
store with a persistent tier, and a synthetic run of thousands of kept steps.
The page is opened in headless Chromium (marker ``browser``): it must draw
every chart and table without a script error and without the network."""

from __future__ import annotations

import json
import os
import struct
import sys

import pytest
import torch

import lazyckpt
from lazyckpt import cli
from lazyckpt.errors import CheckpointNotFoundError
from lazyckpt.storage.localstore import LocalStore
from lazyckpt.study import panels as P
from lazyckpt.study import report as report_module
from lazyckpt.study.report import charts, collect, render, rollbacks, sample, write_report
from lazyckpt.lineage import Event

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _frameworks import under_ci  # noqa: E402
from _report_runs import build_long_run, train_mlp  # noqa: E402

COUNTERS = {f"optimizer/state/{i}/step" for i in range(4)}


@pytest.fixture(scope="module")
def adamw_run(tmp_path_factory):
    run = str(tmp_path_factory.mktemp("report") / "run")
    saved = train_mlp(run, steps=60, every=5)
    assert saved == list(range(0, 60, 5))
    return run


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


# --------------------------------------------------------------------------- the history plot


def test_the_history_plot_of_the_issue_run_has_a_panel_per_group_counters_out_log_and_the_loss(adamw_run,
                                                                                              tmp_path, capsys):
    pytest.importorskip("matplotlib")
    traj = lazyckpt.trajectory(adamw_run, fn="norm")
    table, numel = traj.table(), traj.numel()
    assert len(table) == 16 and COUNTERS <= set(table)
    shown, left_out = P.panels(table, numel)
    assert [p.title for p in shown] == ["model", "optimizer"]
    assert set(left_out) == COUNTERS                       # the 0..55 counters no longer set the scale
    by = {p.title: p for p in shown}
    assert len(by["model"].lines) == 4 and len(by["optimizer"].lines) == 8
    assert by["optimizer"].log                              # exp_avg_sq ~1e-5 beside exp_avg ~1e-1
    # --counters: asked for, they are drawn (in the optimizer's panel).
    with_counters, none_out = P.panels(table, numel, counters=True)
    assert not none_out and COUNTERS <= set({k for p in with_counters for k in p.lines})

    png = tmp_path / "h.png"
    assert cli.main(["history", adamw_run, "--png", str(png), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "deprecated" in err and "counters left out (--counters to plot them)" in err
    width, height = _png_size(png)
    assert width > 1.5 * height                             # 3 panels (loss, model, optimizer) in 2 columns x 2 rows
    # One panel per regex group: weights, biases, moments.
    png2 = tmp_path / "g.png"
    assert cli.main(["trajectory", adamw_run, "--png", str(png2), "--group", r"exp_avg_sq|exp_avg|weight|bias",
                     "--counters", "--no-progress"]) == 0
    assert "counters left out" not in capsys.readouterr().err
    groups, _ = P.panels(table, numel, group=r"exp_avg_sq|exp_avg|weight|bias", counters=True)
    assert {p.title for p in groups} == {"weight", "bias", "exp_avg", "exp_avg_sq", "other"}


def test_metrics_come_from_the_saves_metadata(adamw_run):
    found = P.metrics({0: {"step": 0, "loss": 1.5, "flag": True, "name": "x", "eval": {"acc": 0.5}},
                       5: {"loss": 0.5, "eval": {"acc": 0.75}, "nan": float("nan")}})
    assert found == {"loss": {0: 1.5, 5: 0.5}, "eval/acc": {0: 0.5, 5: 0.75}}
    report = collect(adamw_run, norm_steps=4)
    assert set(report.metrics) == {"loss", "lr"} and sorted(report.metrics["loss"]) == list(range(0, 60, 5))
    assert report.metrics["loss"][0] > report.metrics["loss"][55]      # it learned


def test_lines_beyond_the_colours_get_their_own_dash_and_decades_go_log():
    styles = [P.style(i) for i in range(P.MAX_LINES)]
    assert len(set(styles)) == P.MAX_LINES                 # 40 lines, 40 looks
    assert styles[0][1] == 0 and styles[10][1] == 1 and styles[10][0] == styles[0][0]
    assert P.wants_log([1e-5, 1e-1]) and not P.wants_log([1.0, 50.0]) and not P.wants_log([0.0, 3.0])
    assert P.is_counter([0.0, 5.0, 55.0], 1) and not P.is_counter([0.5, 1.0], 1) and not P.is_counter([1.0], 4)
    many = {f"model/w{i}": {0: float(i + 1), 1: float(i + 2)} for i in range(P.MAX_LINES + 3)}
    (panel,), _ = P.panels(many, {k: 10 for k in many})
    assert len(panel.lines) == P.MAX_LINES and "3 more tensors not drawn" in panel.notes[0]
    with pytest.raises(ValueError, match="not a regular expression"):
        P.panels(many, {}, group="(")


# --------------------------------------------------------------------------- what the report holds


def test_the_report_of_the_issue_run(adamw_run, tmp_path):
    pytest.importorskip("plotly")
    report = write_report(adamw_run, str(tmp_path / "r.html"), top=5)
    assert report.kept == list(range(0, 60, 5)) and set(report.tiers.values()) == {"local"}
    assert report.manifests_read == 12 and not report.rollbacks
    assert all(r["bytes"] > 0 and r["seq"] and not r["references"] for r in report.rows)
    # Movers: step 0 to 55 by default, the counters left out, five rows.
    assert (report.from_step, report.to_step) == (0, 55)
    movers = report.diff.compared
    assert len(movers) == 5 and not {r.key for r in movers} & COUNTERS
    assert [r.rel_change for r in movers] == sorted((r.rel_change for r in movers), reverse=True)
    # Costs as the manifests record them.
    costs = report.costs()
    assert len(costs) == 12 and all(c["gb_per_s"] > 0 and c["bytes"] == c_row["bytes"]
                                    for c, c_row in zip(costs, report.rows))
    assert sum(1 for c in costs if c["barrier_wait_s"] is not None) >= 10
    page = (tmp_path / "r.html").read_text()
    assert page.count('class="chart"') == 9       # tiers, sizes, loss, lr, 2 norm groups, movers, costs, rate
    assert "https://" not in page.split("<script>", 1)[0]  # nothing before plotly.js points outside
    doc = report.to_json()
    json.dumps(doc, allow_nan=False)
    assert doc["kept"] == 12 and doc["counters_left_out"] and doc["diff"]["compared"] == 5
    # --from/--to, and steps that are not kept.
    between = collect(adamw_run, from_step=10, to_step=20, norm_steps=3)
    assert (between.from_step, between.to_step) == (10, 20) and {10, 20} <= set(between.norm_steps)
    with pytest.raises(CheckpointNotFoundError, match="--from 7 is not a kept step"):
        collect(adamw_run, from_step=7)
    with pytest.raises(CheckpointNotFoundError, match="no such Checkpointer directory"):
        collect(str(tmp_path / "nothing"))


def test_rollbacks_incremental_references_and_the_cli(tmp_path, capsys):
    pytest.importorskip("plotly")
    run = str(tmp_path / "run")
    train_mlp(run, steps=30, every=5, frozen=True, incremental=True)    # steps 0..25
    with lazyckpt.Checkpointer(run, keep=None, incremental=True) as ckpt:  # resumed from step 10
        ckpt.save({"model": {"w": torch.ones(3)}}, 12,
                  metadata={"loss": 0.3}).wait()
    report = collect(run, norm_steps=3)
    assert report.kept == [0, 5, 10, 12]
    (rb,) = report.rollbacks
    assert rb["step"] == 12 and rb["superseded"] == [15, 20, 25]
    assert any(r["references"] for r in report.rows if r["step"] in (5, 10))   # incremental saves
    out = tmp_path / "page.html"
    assert cli.main(["report", run, "-o", str(out), "--from", "5", "--to", "10", "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["rollbacks"][0]["superseded"] == [15, 20, 25] and doc["from"] == 5 and doc["to"] == 10
    assert f"wrote {out}" in captured.err and out.stat().st_size > 1_000_000
    page = out.read_text()
    assert 'class="rollbacks"' in page and "resumed from an earlier step" in page
    # Pure: a part of the events gives a part of the answer, never a wrong one.
    events = [Event(1, "a", 1), Event(2, "b", 2), Event(3, "c", 3), Event(2, "d", 4)]
    assert rollbacks(events) == [{"seq": 4, "step": 2, "save_id": "d", "superseded": [2, 3]}]
    assert rollbacks(events[1:]) == [{"seq": 4, "step": 2, "save_id": "d", "superseded": [2, 3]}]
    assert rollbacks(events[:3]) == []


def test_a_run_of_one_step_without_metadata_or_tensors_that_move(tmp_path):
    pytest.importorskip("plotly")
    run = str(tmp_path / "one")
    with lazyckpt.Checkpointer(run) as ckpt:
        ckpt.save({"w": torch.ones(3), "note": "x", "count": torch.tensor(3)}, 7).wait()
    report = write_report(run, str(tmp_path / "one.html"))
    assert report.kept == [7] and report.diff is None and report.metrics == {}
    assert report.panels()[1] == ["count"]                 # a counter, left out
    page = (tmp_path / "one.html").read_text()
    assert "One step compared with itself (step 7): nothing moved." in page
    assert "No number in the sampled saves' <code>metadata=</code>" in page


def test_the_report_needs_plotly_and_says_how_to_get_it(adamw_run, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "plotly", None)
    out = tmp_path / "x.html"
    assert cli.main(["report", adamw_run, "-o", str(out)]) == 2
    assert "pip install 'lazyckpt[report]'" in capsys.readouterr().err and not out.exists()


def test_a_long_run_reads_only_its_index_and_the_sampled_manifests(tmp_path, monkeypatch):
    """Thousands of kept steps: the manifests read are the sample's, the
    tensors those of the norm steps and the two compared steps."""
    pytest.importorskip("plotly")
    run = str(tmp_path / "long")
    build_long_run(run, 2000, real=8)
    reads = []
    real_read = LocalStore.read_manifest

    def counting(self, step_path, options):
        reads.append(os.path.basename(step_path))
        return real_read(self, step_path, options)
    monkeypatch.setattr(LocalStore, "read_manifest", counting)
    report = collect(run, max_steps=100, norm_steps=10)
    assert len(report.kept) == 2000 and report.manifests_read == 100 == len(report.rows)
    manifest_reads = len(reads)
    # The sample's manifests, then each norm step's and the two compared steps' once more under their holds.
    assert manifest_reads <= 100 + 2 * (10 + 2)
    assert len(set(reads)) <= 100
    assert sorted(report.metrics["loss"]) == [r["step"] for r in report.rows]
    assert report.norm_steps[0] == 0 and report.norm_steps[-1] == 1999 and len(report.norm_steps) == 10
    page = render(report)
    assert page.count('class="chart"') >= 8 and "100 of 2,000 steps sampled" in page
    tier = charts(report)[0]["data"][0]
    assert tier["mode"] == "markers" and len(tier["x"]) == 2000
    # Above MARKERS_UP_TO kept steps, a run of steps is one line (an SVG element per step lays out slowly).
    monkeypatch.setattr(report_module, "MARKERS_UP_TO", 1000)
    tier = charts(report)[0]["data"][0]
    assert tier["mode"] == "lines" and tier["x"] == list(range(2000))
    assert sample(list(range(2000)), 100, must=(7,))[1] == 7


# --------------------------------------------------------------------------- object store, two tiers


@pytest.mark.timeout(600)
def test_the_report_of_an_object_store_run_and_of_a_persistent_tier(tmp_path, s3_server, s3_bucket, monkeypatch):
    pytest.importorskip("plotly")
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    url = f"s3://{s3_bucket}/run"
    train_mlp(url, steps=20, every=5)
    report = collect(url, norm_steps=3)
    assert report.kept == [0, 5, 10, 15] and set(report.tiers.values()) == {"object store"}
    assert report.metrics["loss"] and report.diff.compared and report.costs()
    local, tier = str(tmp_path / "local"), f"s3://{s3_bucket}/tier"
    with lazyckpt.Checkpointer(local, keep=1, persist=tier) as ckpt:
        for s in (1, 2, 3):
            ckpt.save({"w": torch.full((4,), float(s))}, s, metadata={"loss": 1.0 / s}).wait(persisted=True)
    both = collect(local, persist_to=tier, norm_steps=3)
    assert both.tiers == {1: "persistent", 2: "persistent", 3: "local+persistent"}
    assert sorted(both.metrics["loss"]) == [1, 2, 3] and both.diff.compared[0].key == "w"
    assert "local+persistent" in render(both)


# --------------------------------------------------------------------------- a real browser


def _browser_or_skip():
    """Playwright and Debian's chromium, or a skip that says which is missing (a failure under CI,
    which installs both: scripts/setup.sh)."""
    import _browser
    missing = []
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("the playwright package (extra 'test')")
    if _browser.find_chromium() is None:
        missing.append("chromium (apt-get install chromium; scripts/setup.sh does it as root)")
    if missing:
        if under_ci():
            pytest.fail(f"the browser test needs {' and '.join(missing)}, which CI installs")
        pytest.skip(f"needs {' and '.join(missing)}")
    return _browser


@pytest.mark.browser
@pytest.mark.timeout(300)
def test_the_page_renders_in_headless_chromium_without_errors_or_network(adamw_run, tmp_path):
    pytest.importorskip("plotly")
    browser = _browser_or_skip()
    page = tmp_path / "report.html"
    report = write_report(adamw_run, str(page), top=8)
    shot = tmp_path / "shot.png"
    seen = browser.open_page(str(page), screenshot=str(shot), timeout_s=120)
    assert seen["errors"] == [], seen["errors"]
    assert seen["requests"] == [], f"the page reached for the network: {seen['requests']}"
    assert seen["charts"] == seen["drawn"] == seen["rendered"] == 9, seen
    # Every chart drew its lines: the tiers, sizes, loss, lr, 2 norm groups, movers, costs, rate.
    traces = seen["traces"]
    assert traces["chart-norms-0"] == 4 and traces["chart-norms-1"] == 8 and traces["chart-costs"] == 4, traces
    assert all(n >= 1 for n in traces.values()), traces
    assert seen["tables"] == {"movers": 8, "costs": 6, "steps": len(report.rows)}, seen["tables"]
    assert seen["sections"] == ["summary", "history", "metrics", "norms", "movers", "costs", "steps"]
    width, height = _png_size(shot)
    assert width == 1400 and height > 2000                 # the whole page, charts and tables
    assert shot.stat().st_size > 100_000                   # drawn, not blank
