"""The compiled-kernel cache on disk: ``python -m mok_cute.cache [--info | --clear | --prune]``.

Kernels compiled in one process are loaded by the next instead of compiled again
(:mod:`mok_cute.dsl.disk_cache`). The directory is ``MOK_CUTE_CACHE_DIR``, by default
``$XDG_CACHE_HOME/mok_cute``, else ``~/.cache/mok_cute`` (``off``: no disk cache,
:func:`mok_cute.dsl.env.cache_dir`). Entries are
keyed by mok_cute's kernel sources, the CuTe DSL version and settings, the target arch and the
compile-time parameters, so an edit or an upgrade only makes new entries: ``--prune`` removes the
old ones. Needs neither a GPU nor the DSL imported.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mok_cute.dsl import disk_cache, env


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_info(info: dict) -> str:
    """:func:`mok_cute.dsl.disk_cache.info` as lines of text."""
    if info["directory"] is None:
        where = f"off ({env.CACHE_DIR}={'|'.join(env.CACHE_OFF)}; unset, 'on' or a directory turns it on): " \
                "every process compiles its kernels"
    else:
        where = info["directory"]
    rows = [("directory", where),
            ("entries", f"{info['entries']} ({info['current']} for these sources and this DSL)"),
            ("size", _size(info["bytes"])),
            ("DSL version", f"{info['dsl_version']} (nvidia-cutlass-dsl)"),
            ("source hash", info["source_hash"])]
    if info["temporary"]:
        rows.append(("temporary", f"{info['temporary']} directories of interrupted writes (--prune removes them)"))
    return "\n".join(f"{k:<12} {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mok_cute.cache", description=__doc__.split("\n\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--info", action="store_true", help="directory, entries, size, DSL version (the default)")
    what.add_argument("--clear", action="store_true", help="remove every entry")
    what.add_argument("--prune", action="store_true",
                      help="remove the entries of other sources or DSL versions, and leftovers of interrupted writes")
    ap.add_argument("--dir", type=Path, default=None, help=f"this cache directory instead of {env.CACHE_DIR}'s")
    ap.add_argument("--json", action="store_true", help="--info as JSON")
    args = ap.parse_args(argv)
    root = args.dir.resolve() if args.dir is not None else disk_cache.directory()
    if (args.clear or args.prune) and root is None:
        print(f"{env.CACHE_DIR} is off: no cache directory", file=sys.stderr)
        return 1
    if args.clear or args.prune:
        n = disk_cache.clear(root, stale_only=args.prune)
        print(f"removed {n} entries from {root}")
        return 0
    info = disk_cache.info(root)
    print(json.dumps(info, indent=1) if args.json else format_info(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
