"""MkDocs hook: pages made of a file that lives outside docs/ (the README,
BENCHMARKS.md), and links between the repository's files that read right both
on GitHub and on the site.

A page whose markdown is the one line ``<!-- include: ../PATH -->`` is
replaced by that file. Every page's relative links are then resolved against
the directory of the file they were written in (the repository root for an
included root file): a target inside docs/ becomes a link relative to the
page; a target elsewhere in the repository (a script, a test, a source file)
is not part of the site, so it becomes its path in code type; a target that
exists nowhere is left as written, and ``mkdocs build --strict`` fails on it.
"""

from __future__ import annotations

import os
import re

INCLUDE = re.compile(r"^\s*<!--\s*include:\s*(\S+)\s*-->\s*$")
# [text](target) and ![alt](target); not reference-style links, which the docs do not use.
LINK = re.compile(r"(!?)\[([^\]\n]*)\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(\s*)(```|~~~)")


def _rewrite(markdown: str, source_dir: str, page_dir: str, docs_dir: str, repo_root: str) -> str:
    def one(match: re.Match) -> str:
        bang, text, target = match.groups()
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return match.group(0)                       # a URL, an anchor or an absolute path
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(source_dir, path))
        if not os.path.exists(resolved):
            return match.group(0)                       # broken: left for --strict to report
        if resolved == docs_dir or resolved.startswith(docs_dir + os.sep):
            rel = os.path.relpath(resolved, page_dir).replace(os.sep, "/")
            return f"{bang}[{text}]({rel}{'#' + anchor if anchor else ''})"
        shown = os.path.relpath(resolved, repo_root).replace(os.sep, "/")
        if bang:
            return f"`{shown}`"
        return text if text.strip("`").rstrip("/") == shown else f"{text} (`{shown}`)"

    out, fenced = [], None
    for line in markdown.splitlines(keepends=True):
        fence = FENCE.match(line)
        if fence:
            fenced = None if fenced == fence.group(2) else (fenced or fence.group(2))
            out.append(line)
            continue
        out.append(line if fenced else LINK.sub(one, line))
    return "".join(out)


def on_page_markdown(markdown, page, config, files):
    docs_dir = os.path.abspath(config["docs_dir"])
    repo_root = os.path.dirname(os.path.abspath(config["config_file_path"]))
    page_dir = os.path.dirname(os.path.abspath(page.file.abs_src_path))
    source_dir = page_dir
    lines = markdown.strip().splitlines()
    if len(lines) == 1 and INCLUDE.match(lines[0]):
        included = os.path.normpath(os.path.join(page_dir, INCLUDE.match(lines[0]).group(1)))
        with open(included, encoding="utf-8") as f:
            markdown = f.read()
        source_dir = os.path.dirname(included)
    return _rewrite(markdown, source_dir, page_dir, docs_dir, repo_root)
