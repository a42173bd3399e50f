"""What every ``lazyckpt`` subcommand prints with: JSON documents and aligned text tables."""

from __future__ import annotations

import json
import sys
from typing import Any, List, Tuple



def print_json(doc: Any) -> None:
    json.dump(doc, sys.stdout, indent=1, default=str)
    sys.stdout.write("\n")


def text_table(headers: List[str], rows: List[List[str]], right: Tuple[int, ...] = ()) -> List[str]:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def fmt_row(r: List[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    return [fmt_row(headers)] + [fmt_row(r) for r in rows]
