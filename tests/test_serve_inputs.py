"""What ``hpc-tp generate`` takes as users give it: a checkpoint trained with sequence parallelism
generates at tp > 1 (the same tokens as at tp = 1), and a --prompts line's "stop" may be one string,
as the HTTP API's."""

import json

import pytest
from test_generate import _model, write_checkpoint
from test_train import settings

from hpc_tp.cli import main
from hpc_tp.comm.mpi import self_comm, world
from hpc_tp.grid import ProcessGrid
from hpc_tp.serve.generate import Engine
from hpc_tp.serve.sampling import SamplingParams
from hpc_tp.tokenizer import ByteTokenizer


def _generate(ckpt, inputs, out, *flags):
    comm = world()
    code = main(
        ["generate", "--ckpt", str(ckpt), "--prompts", str(inputs), "--out", str(out), "--dtype", "float64", *flags]
    )
    comm.barrier()
    return code, [json.loads(line) for line in out.read_text().splitlines()] if code == 0 else None


def _write_lines(path, lines):
    comm = world()
    if comm.rank == 0:
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    comm.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_sequence_parallel_checkpoint_generates_at_tp_above_one(tmp_path, moe):
    """Sequence parallelism is a training layout: inference builds the model without it (it stopped
    generate at tp > 1 and took serve down on its first request)."""
    from hpc_tp.train.trainer import Trainer

    comm = world()
    folder = comm.bcast_object(tmp_path)
    overrides = {"sequence_parallel": True, **({"num_experts": 4, "top_k": 2, "capacity_factor": 1.0} if moe else {})}
    Trainer(settings(steps=2, warmup=1, tp=comm.size, save=str(folder / "ckpt"), model_overrides=overrides), comm).run()
    _write_lines(folder / "in.jsonl", [{"prompt": p} for p in ("12+34=", "7+5=", "99+1=")])
    got = {}
    for tp in (comm.size, 1):
        code, records = _generate(
            folder / "ckpt", folder / "in.jsonl", folder / f"out{tp}.jsonl", "--tp", str(tp), "--max-new-tokens", "4"
        )
        assert code == 0
        got[tp] = [(r["completion"], r["completion_tokens"]) for r in records]
    assert got[comm.size] == got[1] and any(n for _, n in got[1])  # the tiny model stops early on EOS


@pytest.mark.mpi(min_size=1)
def test_a_prompts_line_takes_one_stop_string_or_a_list(tmp_path):
    comm = world()
    folder = comm.bcast_object(tmp_path)
    ckpt = write_checkpoint(folder / "ckpt", "gpt2", ProcessGrid(tp=comm.size, world=comm))
    engine = Engine(_model("gpt2", self_comm()), ByteTokenizer())
    prompt = "Hello"
    plain, _ = engine.generate([list(prompt.encode())], [SamplingParams(max_new_tokens=12)])
    stop = plain[0].text[3:5]
    want, _ = engine.generate([list(prompt.encode())], [SamplingParams(max_new_tokens=12, stop=[stop])])
    assert len(stop) == 2 and want[0].finish_reason == "stop"
    _write_lines(folder / "in.jsonl", [{"prompt": prompt, "stop": stop}, {"prompt": prompt, "stop": [stop]}])
    code, records = _generate(ckpt, folder / "in.jsonl", folder / "out.jsonl", "--max-new-tokens", "12")
    assert code == 0
    assert [(r["completion"], r["finish_reason"]) for r in records] == [(want[0].text, "stop")] * 2
    for bad in (5, [""], None):  # anything else is still a one-line error on every rank
        _write_lines(folder / "bad.jsonl", [{"prompt": prompt, "stop": bad}])
        assert _generate(ckpt, folder / "bad.jsonl", folder / "never.jsonl")[0] == 2
    assert not (folder / "never.jsonl").exists()


@pytest.mark.mpi(min_size=1)
def test_a_prompts_line_of_chat_messages_is_its_rendered_prompt(tmp_path):
    """``generate --prompts``: a line with "messages" is completed as the chat template renders them
    (``--chat-template``, the byte tokenizer carrying none); without a template, or with messages the
    template refuses, one error line on every rank and no output."""
    comm = world()
    folder = comm.bcast_object(tmp_path)
    ckpt = write_checkpoint(folder / "ckpt", "gpt2", ProcessGrid(tp=comm.size, world=comm))
    if comm.rank == 0:
        (folder / "chat.jinja").write_text(
            "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
            "{{ raise_exception('the system message comes first') }}{% endif %}"
            "{{ m['role'][0] }}:{{ m['content'] }}|{% endfor %}a:"
        )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = "s:Be brief.|u:Hi|a:"
    engine = Engine(_model("gpt2", self_comm()), ByteTokenizer())
    want, _ = engine.generate([list(rendered.encode())], [SamplingParams(max_new_tokens=5)])
    _write_lines(folder / "in.jsonl", [{"messages": messages, "id": "chat"}, {"prompt": rendered}])
    template = ["--chat-template", str(folder / "chat.jinja"), "--max-new-tokens", "5"]
    code, records = _generate(ckpt, folder / "in.jsonl", folder / "out.jsonl", *template)
    assert code == 0
    assert [(r["id"], r["prompt"], r["completion"]) for r in records] == [
        ("chat", rendered, want[0].text),
        (1, rendered, want[0].text),
    ]
    assert _generate(ckpt, folder / "in.jsonl", folder / "never.jsonl")[0] == 2  # no template
    for bad in ({"messages": messages[::-1]}, {"messages": messages, "prompt": rendered}):
        _write_lines(folder / "bad.jsonl", [bad])
        assert _generate(ckpt, folder / "bad.jsonl", folder / "never.jsonl", *template)[0] == 2
    assert not (folder / "never.jsonl").exists()
