"""``hpc-tp inspect CKPT``: a checkpoint's step, meta (model config), tensors and verification.

One process, no MPI: it opens the HDF5 files directly.
"""

from __future__ import annotations

import json

_SHORT_VALUE = 100  # longer meta values (RNG states) are summarised, not printed


def add_arguments(parser):
    parser.add_argument("checkpoint", help="a checkpoint folder, or a folder of checkpoints (its latest is shown)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--no-verify", action="store_true", help="skip reading every tensor to check its checksums")


def run(args) -> int:
    from .read import describe_checkpoint, verify_checkpoint

    info = describe_checkpoint(args.checkpoint)
    info["problems"] = None if args.no_verify else verify_checkpoint(info["path"])
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(_text(info))
    return 1 if info["problems"] else 0


def _text(info: dict) -> str:
    layout = info["saved_layout"]
    lines = [
        f"checkpoint  {info['path']}",
        f"step        {info['step']}",
        f"saved at    tp={layout['tp']} pp={layout['pp']} dp={layout['dp']} (loads at any layout)",
        f"files       {', '.join(info['files']) or '-'}",
        "meta",
    ]
    lines += list(_meta_lines(info["meta"], "  "))
    lines.append("")
    rows = [
        (
            t["name"],
            "x".join(map(str, t["shape"])),
            "-" if t["split_axis"] is None else str(t["split_axis"]),
            t["dtype"],
            _size(t["bytes"]),
            str(t["pieces"]),
        )
        for t in info["tensors"]
    ]
    header = ("tensor", "shape", "split", "dtype", "size", "pieces")
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header] + rows]
    total = sum(t["bytes"] for t in info["tensors"])
    lines += [f"{len(rows)} tensors, {_size(total)}", ""]
    problems = info["problems"]
    if problems is None:
        lines.append("verify      skipped")
    elif problems:
        lines += [f"verify      FAILED ({len(problems)} problems)"] + [f"  {p}" for p in problems]
    else:
        lines.append("verify      OK (every checksum and shard file)")
    return "\n".join(lines)


def _meta_lines(mapping: dict, indent: str):
    for key, value in mapping.items():
        text = json.dumps(value)
        if len(text) <= _SHORT_VALUE:
            yield f"{indent}{key}: {text}"
        elif isinstance(value, dict):  # the model config: shown in full, one key a line
            yield f"{indent}{key}:"
            yield from _meta_lines(value, indent + "  ")
        else:
            yield f"{indent}{key}: " + (
                f"<list of {len(value)}>" if isinstance(value, list) else text[:_SHORT_VALUE] + "..."
            )


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
