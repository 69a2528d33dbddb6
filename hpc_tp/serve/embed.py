"""``hpc-tp embed``: sentence embeddings and token states from a BERT-style encoder checkpoint.

    hpc-tp embed --ckpt CKPT --text "a sentence" [--text ...]        JSON lines to stdout
    mpiexec -n 4 hpc-tp embed --ckpt CKPT --inputs IN.jsonl --out OUT.jsonl

Each rank loads only its slice of the weights (heads and vocabulary split over tp). World rank 0
reads and tokenizes the inputs (the checkpoint's tokenizer.json, with its special tokens such as
[CLS] and [SEP]) and writes the results; the batches are padded to their longest row and the
padding is masked out of attention and out of the pooling. A sentence embedding is the mean of
its real tokens' final states, L2-normalised. With tp < world size the data-parallel replicas
take turns over the batches.

An input line is {"text": TEXT} or {"ids": [token ids]}, with optional "id" (a string or an integer)
and "type_ids"; more tokens than the model's max_seq_len are an error, for a text too.
An output line: {"id", "tokens", "embedding"} and, with --token-states, "token_states" [T, hidden].
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..comm.base import on_rank0
from ..errors import ConfigError
from ..jsonl import read_json_lines
from ..paths import check_output_file
from .command import add_model_arguments
from .encoder import check_row, encode_batch, integer, mean_pool, pad_id_of, show

INPUT_KEYS = ("text", "ids", "id", "type_ids")


def add_arguments(parser):
    add_model_arguments(parser, stages=False)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", action="append", help="a text to embed (repeatable)")
    source.add_argument("--inputs", metavar="FILE.jsonl", help='JSON lines, each {"text": TEXT} or {"ids": [...]}')
    parser.add_argument("--out", metavar="FILE.jsonl", help="results as JSON lines (default: stdout)")
    parser.add_argument("--batch-size", type=int, default=16, help="inputs run together (default %(default)s)")
    parser.add_argument("--token-states", action="store_true", help="also write every token's final state")


def run(args) -> int:
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size}: expected an integer >= 1")
    if args.out is not None:  # every rank, though rank 0 alone writes it: they fail together
        check_output_file(args.out, "--out")
    grid, model, tokenizer = load_encoder(args)
    world = grid.world
    rows = on_rank0(world, lambda: read_inputs(args, tokenizer, model.cfg))
    batches = [rows[i : i + args.batch_size] for i in range(0, len(rows), args.batch_size)]
    pad_id = pad_id_of(tokenizer)
    mine = []
    for b in range(grid.coords.dp, len(batches), grid.dp_size):
        states, mask = encode_batch(model, batches[b], pad_id)
        if grid.coords.tp == 0:  # token states are replicated over tp: one rank reports them
            pooled = mean_pool(states, mask)
            for row, n, vector, state in zip(batches[b], mask.sum(axis=1), pooled, states):
                mine.append(
                    {
                        "id": row["id"],
                        "tokens": int(n),
                        "embedding": vector.tolist(),
                        **({"token_states": state[: int(n)].tolist()} if args.token_states else {}),
                    }
                )
    records = [r for part in world.allgather_object(mine) for r in part]
    if world.rank == 0:
        order = {row["id"]: i for i, row in enumerate(rows)}
        _write(args, sorted(records, key=lambda r: order[r["id"]]))
    return 0


def load_encoder(args, opened=None):
    """(grid, BertModel, tokenizers.Tokenizer or None) from ``args.ckpt``, or from ``opened``
    (``open_checkpoint``'s answer); collective over the world."""
    # loaded when the command runs, not by hpc-tp --help
    from ..backend import resolve_dtype
    from ..checkpoint import load_checkpoint
    from ..models.bert import BertModel
    from .loading import open_checkpoint

    grid, folder, cfg = opened or open_checkpoint(args)
    if cfg.family != "bert":
        raise ConfigError(
            f"checkpoint {folder} holds a {cfg.family} decoder: embed needs a BERT encoder "
            "(use `hpc-tp generate` for decoders)"
        )
    model = BertModel(cfg, grid.tp, dtype=resolve_dtype(args.dtype))
    model.rng.training = False
    load_checkpoint(folder, model.state(), grid)
    tokenizer = None
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tokenizer.no_padding()  # a tokenizer.json may pad to a fixed length: batches are padded and masked here
        tokenizer.no_truncation()  # a text longer than max_seq_len is an error (read_inputs), never cut short
    return grid, model, tokenizer


def read_inputs(args, tokenizer, cfg) -> list[dict]:
    """Rows {id, ids, type_ids} from --text or --inputs, checked against the model."""
    # loaded when the command runs, not by hpc-tp --help
    from ..tokenizer import utf8

    if args.text is not None:
        lines = [(f"--text {n}", {"text": t}) for n, t in enumerate(args.text, start=1)]
    else:
        path = Path(args.inputs)
        lines = []
        for n, line in read_json_lines(path, "--inputs"):
            if ("text" in line) == ("ids" in line) or set(line) - set(INPUT_KEYS):
                got = f"keys {sorted(line)}"
                raise ConfigError(
                    f'--inputs {path} line {n}: expected an object with "text" or "ids" '
                    f"(and optional id, type_ids), got {got}"
                )
            lines.append((f"--inputs {path} line {n}", line))
    rows, seen = [], set()
    for n, (label, line) in enumerate(lines):
        row_id = line.get("id", n)
        if not (isinstance(row_id, str) or integer(row_id)):  # it orders the results and is written back
            raise ConfigError(f'{label}: "id" {show(row_id)}: expected a string or an integer')
        if row_id in seen:
            raise ConfigError(
                f'{label}: "id" {show(row_id)} is used twice; expected unique ids '
                "(a line without one has its 0-based position)"
            )
        seen.add(row_id)
        if "text" in line:
            if not isinstance(line["text"], str):
                raise ConfigError(f'{label}: "text" {show(line["text"])}: expected a string')
            if tokenizer is None:
                raise ConfigError(f'{label}: the checkpoint has no tokenizer.json; give token ids ({{"ids": [...]}})')
            try:
                utf8(line["text"])  # a lone surrogate ("\\ud800") would be the tokenizer's TypeError
            except ConfigError as e:
                raise ConfigError(f"{label}: {e}") from None
            encoding = tokenizer.encode(line["text"])
            ids, type_ids = encoding.ids, encoding.type_ids
        else:
            ids = line["ids"]
            type_ids = [0] * len(ids) if isinstance(ids, list) else []  # a bad "ids" is named first
        type_ids = line.get("type_ids", type_ids)
        check_row(label, ids, type_ids, cfg)
        rows.append({"id": row_id, "ids": list(ids), "type_ids": list(type_ids)})
    return rows


def _write(args, records: list[dict]):
    text = "".join(json.dumps(r) + "\n" for r in records)
    if args.out is None:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # as generate --out: a new folder is fine
        Path(args.out).write_text(text)
