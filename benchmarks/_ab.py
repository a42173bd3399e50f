"""The A/B harness shared by the scripts that compare this tree's lazyckpt with
another source tree (``ab_trees.py``, ``ab_save_cpu.py``): one child process
per tree and round with that tree's ``src`` on ``PYTHONPATH``, rounds in ABBA
order (which tree goes first alternates, so a drift during the run favours
neither), medians per tree and the ratios this/baseline. It imports neither
torch nor lazyckpt: the parent only orchestrates."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from typing import Callable, Dict, List, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")


def run_abba(baseline_src: str, rounds: int, child_args: Callable[[str], List[str]],
             env: Dict[str, str] = None) -> Dict[str, List[Dict[str, float]]]:
    """Run ``child_args(tree_name)`` (the arguments after the Python executable)
    once per tree and round; each child prints its figures as JSON on its last
    line. Returns {tree name: [figures per round]}."""
    trees = {"this": SRC, "baseline": os.path.abspath(baseline_src)}
    results: Dict[str, List[Dict[str, float]]] = {name: [] for name in trees}
    for r in range(rounds):
        for name in (list(trees) if r % 2 == 0 else list(reversed(trees))):
            done = subprocess.run([sys.executable] + child_args(name),
                                  env=dict(env or os.environ, PYTHONPATH=trees[name]),
                                  check=True, capture_output=True, text=True)
            results[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {name}: " + " ".join(f"{k}={v:.3f}" for k, v in results[name][-1].items()),
                  flush=True)
    return results


def print_medians(results: Dict[str, List[Dict[str, float]]], metrics: Sequence[str], title: str) -> None:
    """Medians per tree and this/baseline, one row per metric (lower is better)."""
    med = {name: {k: statistics.median(run[k] for run in runs) for k in metrics} for name, runs in results.items()}
    print(f"\n{title}")
    print(f"{'metric':<14}{'baseline':>10}{'this':>10}{'this/baseline':>15}")
    for k in metrics:
        print(f"{k:<14}{med['baseline'][k]:>10.3f}{med['this'][k]:>10.3f}{med['this'][k] / med['baseline'][k]:>15.2f}")
