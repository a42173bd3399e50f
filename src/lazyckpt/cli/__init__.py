"""The ``lazyckpt`` command line.

    lazyckpt ls DIR                       committed steps and leftovers of a Checkpointer directory
    lazyckpt inspect PATH [--json]        entries, dtypes, shapes, sizes, shards of a checkpoint
    lazyckpt verify PATH                  read everything, check every checksum
    lazyckpt convert SRC DST              lazyckpt <-> torch.save <-> safetensors, DCP -> any
    lazyckpt export STEP OUT_DIR --hf     a committed step (any ranks) -> Hugging Face model directory
    lazyckpt import HF_DIR OUT            a Hugging Face model directory -> one lazyckpt file
    lazyckpt prune DIR --keep N           delete older committed steps and leftovers
    lazyckpt diff A B [--top K]           tensor by tensor change between two steps (lazyckpt/study/)
    lazyckpt trajectory RUN --stat norm   a statistic of tensors over every kept step (table, --png)
    lazyckpt advise RUN --mtbf 8h         the checkpoint interval to choose (lazyckpt/cli/advise.py)
    lazyckpt bench [--quick]              side-by-side save/load benchmark

PATH is a ``.lzc`` file, a committed step directory, or a Checkpointer
directory (its latest committed step). ``ls``, ``inspect``, ``verify`` and
``prune`` also take ``s3://BUCKET/...`` URLs: a checkpoint object, a
committed save prefix (``.../step_XXXXXXXXXX/<save_id>``) or a Checkpointer
directory prefix (credentials and endpoint: the standard AWS_* variables, or
LAZYCKPT_STORAGE_OPTIONS as JSON). Errors are reported on one line
(``lazyckpt: error: ...``) with exit status 2; ``verify`` exits with 1 when
it finds damage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional

from lazyckpt import __version__
from lazyckpt.errors import CheckpointError, UnsafeObjectError
from lazyckpt.interop.convert import convert
from lazyckpt.interop.hf import export_hf, import_hf
from lazyckpt.knobs import parse_size
from lazyckpt.loading.verify import verify
from lazyckpt.storage.stores import for_path
from .advise import add_parser as add_advise_parser     # lazyckpt advise: cost figures, formulas
from .inspect import describe, format_time, human_bytes, list_directory
from .output import print_json, text_table
from .prune import prune as prune_steps    # not "prune": that name is the submodule lazyckpt.cli.prune
from .study import add_commands as add_study_commands    # diff, trajectory: lazyckpt/study/

EXIT_OK, EXIT_DAMAGED, EXIT_ERROR = 0, 1, 2


class UsageError(Exception):
    """A mistake in the command line (reported like argparse's own errors)."""


# --------------------------------------------------------------------------- output helpers


class Progress:
    """A tqdm bar over bytes if tqdm is installed and enabled; otherwise nothing."""

    def __init__(self, enabled: bool, desc: str):
        self.bar = None
        self.enabled = enabled
        self.desc = desc

    def total(self, n: int) -> None:
        if not self.enabled or self.bar is not None:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self.bar = tqdm(total=n, unit="B", unit_scale=True, unit_divisor=1024, desc=self.desc,
                        file=sys.stderr, leave=False, dynamic_ncols=True)

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _progress_enabled(args: argparse.Namespace) -> bool:
    if args.progress is not None:
        return args.progress
    return sys.stderr.isatty()


# --------------------------------------------------------------------------- ls


def cmd_ls(args: argparse.Namespace) -> int:
    listing = list_directory(args.dir)
    if args.json:
        print_json(listing)
        return EXIT_OK
    steps = listing["steps"]
    print(f"{listing['directory']}: {len(steps)} committed step{'s' if len(steps) != 1 else ''}"
          + (f", {human_bytes(listing['bytes'])}, latest {listing['latest']}" if steps else ""))
    if steps:
        rows = []
        for r in steps:
            if "error" in r:
                rows.append([str(r["step"]), human_bytes(r["bytes"]), "?", "?", "?", "?", f"manifest unreadable: "
                             f"{r['error']}"])
                continue
            meta = {k: v for k, v in (r.get("metadata") or {}).items() if k != "step"}
            refs = r.get("references") or []
            # An object store's row has "mtime": when its manifest (the commit) was written.
            committed = r["mtime"] if r.get("mtime") is not None else r.get("created_unix")
            rows.append([str(r["step"]), human_bytes(r["bytes"]), format_time(committed),
                         str(r.get("world_size")), str(r.get("files")),
                         ",".join(map(str, refs[:6])) + (",..." if len(refs) > 6 else "") if refs else "-",
                         json.dumps(meta, separators=(",", ":"))[:60] if meta else ""])
        for line in text_table(["step", "size", "committed", "world", "files", "refers to", "metadata"], rows,
                           right=(0, 1, 3, 4)):
            print("  " + line)
    if listing["latest_file"] is not None and listing["latest_file"] != listing["latest"]:
        print(f"note: the advisory `latest` file says {listing['latest_file']} (the listing is authoritative)")
    if listing["leftovers"]:
        print(f"incomplete / leftovers ({len(listing['leftovers'])}, not checkpoints; "
              f"`lazyckpt prune` removes those of dead processes):")
        rows = [[lo["name"], human_bytes(lo["bytes"]), lo["description"]] for lo in listing["leftovers"]]
        for line in text_table(["name", "size", "state"], rows, right=(1,)):
            print("  " + line)
    return EXIT_OK


# --------------------------------------------------------------------------- inspect


def _shape(v: Any) -> str:
    return "[" + ", ".join(map(str, v)) + "]" if isinstance(v, list) else "-"


def cmd_inspect(args: argparse.Namespace) -> int:
    doc = describe(args.path)
    if args.json:
        print_json(doc)
        return EXIT_OK
    where = {"file": "checkpoint file", "step": "committed step directory",
             "directory": "Checkpointer directory"}[doc["kind"]]
    print(f"{doc['path']} ({where})")
    if doc["kind"] == "directory":
        steps = doc["committed_steps"]
        print(f"  latest of {len(steps)} committed step{'s' if len(steps) != 1 else ''}: {doc['step_dir']}")
    facts = [f"format version {doc['format_version']}", f"world size {doc['world_size']}"]
    if doc.get("step") is not None:
        facts.append(f"step {doc['step']}")
    if doc.get("created_unix") is not None:
        facts.append(f"committed {format_time(doc['created_unix'])}")
    print("  " + ", ".join(facts))
    meta = doc.get("metadata") or {}
    if meta:
        print(f"  metadata: {json.dumps(meta, default=str)[:200]}")
    if doc.get("replicated"):
        print(f"  replicated keys (written once): {', '.join(doc['replicated'])}")
    if doc.get("references"):
        print(f"  incremental: refers to bytes held by step(s) {', '.join(map(str, doc['references']))}")
    for f in doc["files"]:
        label = os.path.basename(f["path"]) if f["rank"] is not None else f["path"]
        print(f"\n{label}: {human_bytes(f['bytes'])}, {f['entry_count']} entries "
              f"({human_bytes(f['data_bytes'])} of data), checksum block {human_bytes(f['block_bytes'])}")
        if f.get("size_mismatch"):
            print(f"  warning: the manifest says {f['size_mismatch']['manifest']} bytes, the file has "
                  f"{f['size_mismatch']['actual']}")
        if f.get("references"):
            print(f"  owns {human_bytes(f['owned_bytes'])}; refers to {human_bytes(f['referenced_bytes'])} "
                  f"held by step(s) {', '.join(map(str, f['references']))}")
        rows = []
        for leaf in f["leaves"]:
            t = leaf["type"]
            entry = "-"
            if "entry" in leaf:
                entry = str(leaf["entry"])
                if "held_by_rank" in leaf:
                    entry += f" (rank {leaf['held_by_rank']})"
            if t in ("tensor", "dtensor"):
                shape = _shape(leaf.get("shape"))
                if t == "dtensor":
                    shape += f" local {_shape(leaf.get('local_shape'))} at {_shape(leaf.get('offsets'))}"
                rows.append([leaf["path"], t, str(leaf.get("dtype")), shape,
                             human_bytes(leaf["bytes"]) if "bytes" in leaf else "?", entry])
            elif t == "numpy":
                rows.append([leaf["path"], "numpy", str(leaf.get("dtype")),
                             _shape(leaf.get("shape")) if "shape" in leaf else "scalar",
                             human_bytes(leaf["bytes"]) if "bytes" in leaf else "-", entry])
            elif t == "bytes":
                rows.append([leaf["path"], "bytes", "-", "-", human_bytes(leaf.get("bytes")), entry])
            elif t == "pickle":
                rows.append([leaf["path"], "pickle", str(leaf.get("object_type")), "-",
                             human_bytes(leaf.get("bytes")), entry])
            else:
                rows.append([leaf["path"], t, "-", "-", "-", f"= {leaf.get('value')}"])
        if args.max_rows and len(rows) > args.max_rows:
            hidden = len(rows) - args.max_rows
            rows = rows[:args.max_rows]
        else:
            hidden = 0
        for line in text_table(["path", "type", "dtype", "shape", "size", "entry"], rows, right=(4,)):
            print("  " + line)
        if hidden:
            print(f"  ... {hidden} more (--max-rows 0 shows all, --json gives everything)")
        if args.entries:
            erows = [[str(e["index"]), e["kind"], str(e["offset"]), str(e["length"]), str(e["checksum_blocks"]),
                      e["name"] + (f" (rank {e['rank']})" if e.get("rank") is not None else "")
                      + (f" (step {e['ref']['step']} rank {e['ref']['rank']} entry {e['ref']['entry']}, "
                         f"{e['ref']['length']} bytes)" if e.get("ref") else "")]
                     for e in f["entries"]]
            print()
            for line in text_table(["entry", "kind", "offset", "length", "blocks", "name"], erows,
                               right=(0, 2, 3, 4)):
                print("  " + line)
    if doc.get("shards"):
        print("\nsharded tensors (DTensor), from the manifest's shard index (pieces derived from "
              "each tensor's mesh and placements where it has a layout):")
        for s in doc["shards"]:
            print(f"  {s['path']}: global {_shape(s.get('global_shape'))} {s.get('dtype')}, "
                  f"{len(s['pieces'])} piece(s)")
            for p in s["pieces"]:
                print(f"    rank {p['rank']}: offsets {_shape(p.get('offsets'))} shape {_shape(p.get('shape'))} "
                      + (f"entry {p.get('entry')}" if p.get("entry") is not None else "(entry in its footer)"))
    return EXIT_OK


# --------------------------------------------------------------------------- verify


def cmd_verify(args: argparse.Namespace) -> int:
    bar = Progress(_progress_enabled(args), "verifying")
    try:
        report = verify(args.path, progress=bar.update, on_total=bar.total, store=for_path(args.path))
    finally:
        bar.close()
    if args.json:
        print_json(report.to_json())
        return EXIT_OK if report.ok else EXIT_DAMAGED
    what = report.target.step_dir or report.target.path
    if report.ok:
        print(f"OK: {what}: {report.files} file(s), {report.entries} entries, "
              f"{human_bytes(report.bytes_checked)} in {report.blocks_checked} checksum block(s), all verified")
        return EXIT_OK
    print(f"DAMAGED: {what}: {len(report.problems)} problem(s) in {report.files} file(s) "
          f"({report.entries} entries, {human_bytes(report.bytes_checked)} checked)")
    for p in report.problems:
        print(f"  {p.what}: {p.message}")
    return EXIT_DAMAGED


# --------------------------------------------------------------------------- convert


def cmd_convert(args: argparse.Namespace) -> int:
    bar = Progress(_progress_enabled(args), "converting")
    try:
        result = convert(args.src, args.dst, args.src_format, args.dst_format, allow_pickle=args.allow_pickle,
                         overwrite=args.force, sep=args.sep, batch_bytes=args.batch_bytes,
                         progress=bar.update, on_total=bar.total)
    except UnsafeObjectError as exc:
        msg = str(exc).replace("Pass allow_pickle=True", "Pass --allow-pickle")
        raise CheckpointError(msg) from None
    finally:
        bar.close()
    print(f"{result.src} ({result.src_format}) -> {result.dst} ({result.dst_format}): {result.tensors} tensors, "
          f"{human_bytes(result.tensor_bytes)}, file {human_bytes(result.file_bytes)}, {result.seconds:.2f} s")
    print(f"  memory: {result.memory}")
    if result.skipped:
        shown = ", ".join(result.skipped[:8]) + (", ..." if len(result.skipped) > 8 else "")
        print(f"  skipped {len(result.skipped)} non-tensor value(s) that {result.dst_format} cannot hold: {shown}",
              file=sys.stderr)
    return EXIT_OK


# --------------------------------------------------------------------------- export / import (Hugging Face)


def cmd_export(args: argparse.Namespace) -> int:
    bar = Progress(_progress_enabled(args), "exporting")
    try:
        result = export_hf(args.src, args.out_dir, key=args.key, prefix=args.prefix, strip=args.strip,
                           dtype=args.dtype, max_shard_size=args.max_shard_size, config=args.config,
                           overwrite=args.force, progress=bar.update, on_total=bar.total)
    finally:
        bar.close()
    step = f" (step {result.step})" if result.step is not None else ""
    print(f"{result.src}{step} -> {result.out_dir}: {result.tensors} tensors under "
          f"{'/'.join(result.key) or '<root>'}, {human_bytes(result.tensor_bytes)} in {len(result.files)} "
          f"file(s), {result.seconds:.2f} s")
    if result.copied:
        print(f"  copied from {args.config}: {', '.join(result.copied)}")
    else:
        print("  no config.json (pass --config DIR): from_pretrained needs one", file=sys.stderr)
    return EXIT_OK


def cmd_import(args: argparse.Namespace) -> int:
    result = import_hf(args.hf_dir, args.out, key=args.key, overwrite=args.force)
    print(f"{result.src} ({len(result.files)} file(s)) -> {result.out}: {result.tensors} tensors, "
          f"{human_bytes(result.tensor_bytes)}, file {human_bytes(result.file_bytes)}, {result.seconds:.2f} s")
    return EXIT_OK


# --------------------------------------------------------------------------- prune


def cmd_prune(args: argparse.Namespace) -> int:
    if args.keep < 1:
        raise UsageError(f"--keep must be at least 1 (got {args.keep}); deleting every checkpoint is not offered")
    result = prune_steps(args.dir, args.keep, dry_run=args.dry_run, force=args.force)
    if args.json:
        print_json(result)
    else:
        verb = "would delete" if args.dry_run else "deleted"
        for a in result["actions"]:
            what = f"step {a['step']}" if a["what"] == "step" else f"leftover {a['name']}"
            if a["error"]:
                print(f"failed to delete {what}: {a['error']}")
            else:
                print(f"{verb} {what} ({human_bytes(a['bytes'])})")
        for lo in result["kept_leftovers"]:
            print(f"kept {lo['name']}: {lo['description']}")
        if result["kept_for_references"]:
            print(f"kept older step(s) {', '.join(map(str, result['kept_for_references']))}: newer kept steps "
                  f"refer to their bytes (incremental)")
        kept = result["kept"]
        print(f"kept {len(kept)} committed step{'s' if len(kept) != 1 else ''}"
              + (f" ({', '.join(map(str, kept))})" if kept else "")
              + ("" if args.dry_run else f"; freed {human_bytes(result['freed_bytes'])}"))
    return EXIT_ERROR if any(a["error"] for a in result["actions"]) else EXIT_OK


# --------------------------------------------------------------------------- bench


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench   # lazy: the peers' harness (1,300 lines, optional peers) loads only for `lazyckpt bench`
    try:
        size = parse_size(args.size) if args.size else (4 << 20 if args.quick else 256 << 20)
        dtypes = bench.parse_dtypes(args.dtypes)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    tensors = args.tensors if args.tensors is not None else (8 if args.quick else 16)
    reps = args.reps if args.reps is not None else (2 if args.quick else bench.DEFAULT_REPS)
    if tensors < 1 or reps < 1:
        raise UsageError("--tensors and --reps must be at least 1")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
    if methods:
        unknown = set(methods) - set(bench.METHOD_KEYS)
        if unknown:
            raise UsageError(f"unknown --methods {', '.join(sorted(unknown))}; choose from "
                             f"{', '.join(bench.METHOD_KEYS)}")
    if args.png or args.timeline:
        try:
            bench.check_plotting()
        except ImportError as exc:
            raise CheckpointError(str(exc)) from None
    if args.dir and not os.path.isdir(args.dir):
        raise CheckpointError(f"{args.dir}: no such directory")
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.verbose else (lambda s: None)
    doc: Dict[str, Any] = {}
    if not args.no_table:
        result = bench.run(size, tensors, dtypes, reps, drop_caches=args.drop_caches, directory=args.dir,
                           methods=methods, keep=args.keep, log=log, seed=args.seed)
        doc.update(result)
        print(bench.format_table(result))
        if args.png:
            bench.plot(result, args.png)
            print(f"chart: {args.png}")
    if args.timeline:
        tl = bench.run_timeline(size, iters=args.iters, every=args.every, directory=args.dir, log=log)
        doc["timeline"] = tl
        if not args.no_table:
            print()
        print(bench.format_timeline(tl))
        bench.plot_timeline(tl, args.timeline)
        print(f"timeline: {args.timeline}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    return EXIT_OK


# --------------------------------------------------------------------------- parser


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lazyckpt", description="Inspect, verify, convert, prune and benchmark "
                                "lazyckpt checkpoints.")
    p.add_argument("--version", action="version", version=f"lazyckpt {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def progress_flags(sp: argparse.ArgumentParser) -> None:
        g = sp.add_mutually_exclusive_group()
        g.add_argument("--progress", dest="progress", action="store_true", default=None,
                       help="show a progress bar (needs tqdm; default: when stderr is a terminal)")
        g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")

    sp = sub.add_parser("ls", help="list committed steps and leftovers of a Checkpointer directory")
    sp.add_argument("dir", metavar="DIR", help="a Checkpointer directory or s3:// prefix")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.set_defaults(func=cmd_ls)

    sp = sub.add_parser("inspect", help="entries, dtypes, shapes, sizes, state paths and shards")
    sp.add_argument("path", metavar="PATH", help="a .lzc file, a step directory or a Checkpointer directory "
                    "(or the same on an object store: an s3:// URL)")
    sp.add_argument("--json", action="store_true", help="everything, machine-readable")
    sp.add_argument("--max-rows", type=int, default=200, metavar="N", help="rows per file (0: all; default 200)")
    sp.add_argument("--entries", action="store_true", help="also list the raw entries (offsets, lengths)")
    sp.set_defaults(func=cmd_inspect)

    sp = sub.add_parser("verify", help="read everything and check every checksum (exit 1 if damaged)")
    sp.add_argument("path", metavar="PATH", help="as for inspect (s3:// URLs too)")
    sp.add_argument("--json", action="store_true")
    progress_flags(sp)
    sp.set_defaults(func=cmd_verify)

    sp = sub.add_parser("convert", help="convert between lazyckpt, torch.save, safetensors (and from DCP)",
                        description="Formats: lazyckpt (.lzc, step or Checkpointer directory), torch "
                        "(.pt .pth .bin .ckpt), safetensors (.safetensors), dcp (a torch.distributed.checkpoint "
                        "directory; source only). Sources are recognized by content, destinations by extension.")
    sp.add_argument("src", metavar="SRC")
    sp.add_argument("dst", metavar="DST")
    sp.add_argument("--from", dest="src_format", choices=["lazyckpt", "torch", "safetensors", "dcp"])
    sp.add_argument("--to", dest="dst_format", choices=["lazyckpt", "torch", "safetensors"])
    sp.add_argument("--allow-pickle", action="store_true",
                    help="allow unpickling arbitrary objects (runs code from the file: trusted files only)")
    sp.add_argument("-f", "--force", action="store_true", help="replace DST if it exists")
    sp.add_argument("--sep", default=".", help="separator of nested keys in flat (safetensors) names")
    sp.add_argument("--batch-bytes", type=_size_arg, default=256 << 20, metavar="SIZE",
                    help="read at most this much at a time when streaming (default 256M)")
    progress_flags(sp)
    sp.set_defaults(func=cmd_convert)

    sp = sub.add_parser("export", help="write a committed step as a Hugging Face model directory",
                        description="Any committed step (one rank or many; DTensor shards are assembled "
                        "reading only the bytes each tensor needs) -> safetensors shards, their index and "
                        "the config/tokenizer files of --config. Memory: about twice the largest tensor.")
    sp.add_argument("src", metavar="STEP_OR_RUN_DIR", help="a step directory, a Checkpointer directory "
                    "(its latest step) or a .lzc file")
    sp.add_argument("out_dir", metavar="OUT_DIR")
    sp.add_argument("--hf", action="store_true", default=True,
                    help="write a Hugging Face model directory (the only export format; the default)")
    sp.add_argument("--config", metavar="DIR", help="copy config.json (required there), tokenizer and "
                    "generation files from DIR; with transformers installed the weights are checked against it")
    sp.add_argument("--key", help="path of the model state in the checkpoint, e.g. model or a/b "
                    "(default: model, module or state_dict, whichever exists)")
    sp.add_argument("--prefix", default="", help="add this prefix to every name")
    sp.add_argument("--strip", default="", help="remove this prefix from the names that have it")
    sp.add_argument("--dtype", help="cast floating-point tensors (bfloat16, float16, float32)")
    sp.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                    help="largest safetensors file (default 5GB, decimal as in transformers; 2GiB is binary)")
    sp.add_argument("-f", "--force", action="store_true", help="replace OUT_DIR if it exists")
    progress_flags(sp)
    sp.set_defaults(func=cmd_export)

    sp = sub.add_parser("import", help="write a Hugging Face model directory as one lazyckpt file",
                        description="The safetensors weights of HF_DIR (one file or sharded with an index) "
                        "-> OUT (.lzc) holding {name: tensor}; lazyckpt.load(OUT, into=model.state_dict()) "
                        "then fills a model on any number of ranks, each reading only its own rows.")
    sp.add_argument("hf_dir", metavar="HF_DIR")
    sp.add_argument("out", metavar="OUT")
    sp.add_argument("--key", help="nest the weights under this key (e.g. model)")
    sp.add_argument("-f", "--force", action="store_true", help="replace OUT if it exists")
    sp.set_defaults(func=cmd_import)

    sp = sub.add_parser("prune", help="delete older committed steps and leftovers of interrupted saves")
    sp.add_argument("dir", metavar="DIR", help="a Checkpointer directory or s3:// prefix")
    sp.add_argument("--keep", type=int, required=True, metavar="N", help="committed steps to keep (newest)")
    sp.add_argument("--dry-run", action="store_true", help="only say what would be deleted")
    sp.add_argument("--force", action="store_true",
                    help="also remove saves whose lease is not held, however recent their heartbeat "
                    "(local directories; on an object store, which has no locks or leases, it is "
                    "accepted and ignored: only saves older than the lease expiry are removed)")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_prune)

    add_advise_parser(sub)

    add_study_commands(sub, progress_flags)

    sp = sub.add_parser("bench", help="side-by-side save/load benchmark against the raw disk and peers",
                        description="Saves and loads one state with every method in the same run. See "
                        "lazyckpt/cli/bench.py for what each column means.")
    sp.add_argument("--size", help="state size, e.g. 256M, 1G (default 256M; --quick: 4M)")
    sp.add_argument("--dtypes", default="fp32", help="comma-separated mix, e.g. fp32,bf16 (default fp32)")
    sp.add_argument("--tensors", type=int, help="number of tensors (default 16; --quick: 8)")
    sp.add_argument("--reps", type=int, help="repetitions, the methods shuffled in each; median and min-max "
                                             "are reported (default 7: the range is then a 98%% interval for "
                                             "the median; --quick: 2)")
    sp.add_argument("--seed", type=int, default=0, help="seed of the methods' order in each repetition (default 0)")
    sp.add_argument("--drop-caches", action="store_true",
                    help="evict the checkpoint from the page cache before each load (globally if permitted, "
                         "else per file)")
    sp.add_argument("--dir", help="where to write (default: a temporary directory under the current one)")
    sp.add_argument("--methods", help="comma-separated subset of the methods (an unknown name lists them)")
    sp.add_argument("--json", metavar="FILE", help="write the results as JSON")
    sp.add_argument("--png", metavar="FILE", help="draw the results (needs matplotlib: lazyckpt[plot])")
    sp.add_argument("--timeline", metavar="PNG",
                    help="also run a short training loop with lazyckpt checkpoints and draw its timeline")
    sp.add_argument("--iters", type=int, default=12, help="timeline: iterations (default 12)")
    sp.add_argument("--every", type=int, default=3, help="timeline: checkpoint every N iterations (default 3)")
    sp.add_argument("--no-table", action="store_true", help="skip the side-by-side table (with --timeline)")
    sp.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of a few seconds")
    sp.add_argument("--keep", action="store_true", help="keep the benchmark directory")
    sp.add_argument("-v", "--verbose", action="store_true", help="progress messages on stderr")
    sp.set_defaults(func=cmd_bench)
    return p


def _error_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and not isinstance(exc, CheckpointError) and exc.strerror:
        where = exc.filename if exc.filename is not None else ""
        return f"{where}: {exc.strerror}" if where else exc.strerror
    text = str(exc).strip() or type(exc).__name__
    lines = text.splitlines()
    return lines[0] + (" ..." if len(lines) > 1 else "")


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except UsageError as exc:
        parser.exit(EXIT_ERROR, f"lazyckpt: error: {exc}\n")
    except BrokenPipeError:          # `lazyckpt inspect ... | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except (CheckpointError, OSError, ImportError) as exc:
        if args.debug:
            raise
        print(f"lazyckpt: error: {_error_line(exc)}", file=sys.stderr)
        code = EXIT_ERROR
    except ValueError as exc:
        if args.debug:
            raise
        print(f"lazyckpt: error: {_error_line(exc)}", file=sys.stderr)
        code = EXIT_ERROR
    except KeyboardInterrupt:
        print("lazyckpt: interrupted", file=sys.stderr)
        code = 130
    try:
        sys.stdout.flush()
    except BrokenPipeError:          # `lazyckpt inspect ... | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return code


def entry_point() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry_point()
