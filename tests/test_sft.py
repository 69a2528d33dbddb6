"""Supervised fine-tuning on chats: the loss on assistant tokens only, the same gradient in every layout,
bad lines named, and a chat dataset the test makes from the demo task learned."""

import json

import numpy as np
import pytest

from hpc_tp.comm.mpi import self_comm, world
from hpc_tp.errors import ConfigError
from hpc_tp.serve.chat import ChatTemplate
from hpc_tp.tokenizer import ByteTokenizer
from hpc_tp.train.chats import build_chat_datasets, render_conversation
from hpc_tp.train.settings import TrainSettings
from hpc_tp.train.tasks import IGNORE, ArithmeticTask
from hpc_tp.train.trainer import Trainer

# ChatML's layout, spelled in bytes: turns open with "<|", close with "|>\n".
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}\n{{ m['content'] }}|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant\n{% endif %}"
)
BYTES = ByteTokenizer()


def write_chats(path, conversations):
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    return path


def arithmetic_chats(n: int, seed: int = 0) -> list[dict]:
    """The demo task's problems as chats: a system turn, the problem, the answer."""
    task = ArithmeticTask(seed=seed)
    return [
        {
            "messages": [
                {"role": "system", "content": "Add."},
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": answer},
            ]
        }
        for prompt, answer in task.train_examples()[:n]
    ]


def test_only_assistant_turns_and_what_closes_them_are_learned():
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "ok?"},
        {"role": "assistant", "content": "ok"},
    ]
    ids, learned = render_conversation(ChatTemplate(TEMPLATE), BYTES, messages, "test")
    text = BYTES.decode(ids)
    assert text == "<|system\nS|>\n<|user\nhi|>\n<|assistant\nyo|>\n<|user\nok?|>\n<|assistant\nok|>\n"
    assert BYTES.decode([i for i, keep in zip(ids, learned) if keep]) == "yo|>\nok|>\n"


def test_prompt_completion_lines_split_and_padding_are_never_targets(tmp_path):
    path = write_chats(tmp_path / "c.jsonl", [{"prompt": "2+2=", "completion": "4"}, *arithmetic_chats(9)])
    train, heldout = build_chat_datasets(path, BYTES, ChatTemplate(TEMPLATE), None, eval_split=0.2, seed=1)
    assert len(train) == 8 and len(heldout) == 2
    ids, targets = train.get(range(len(train)))
    rows = [BYTES.decode([t for t in row if t != IGNORE]) for row in targets]
    assert all(row.endswith("|>\n") and "<|" not in row for row in rows), rows
    assert (ids[targets != IGNORE] >= 0).all() and train.seq_len == max(
        len(BYTES.encode(ChatTemplate(TEMPLATE).render(c["messages"], add_generation_prompt=False))) - 1
        for c in arithmetic_chats(9)
    )


@pytest.mark.parametrize(
    "line,reason",
    [
        ("{not json", "c.jsonl:2: not a JSON line"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "line 2: the conversation has no assistant turn"),
        ('{"text": "hi"}', 'line 2: expected {"messages"'),
        (
            json.dumps({"messages": [{"role": "user", "content": "x" * 200}, {"role": "assistant", "content": "y"}]}),
            "line 2: the conversation is 226 tokens, more than --seq-len 64 + 1",
        ),
    ],
)
def test_a_bad_line_is_one_error_naming_it(tmp_path, line, reason):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(arithmetic_chats(1)[0]) + "\n" + line + "\n")
    with pytest.raises(ConfigError, match=reason.replace("{", r"\{").replace("+", r"\+")):
        build_chat_datasets(path, BYTES, ChatTemplate(TEMPLATE), 64)


def test_chats_without_a_template_are_refused(tmp_path):
    path = write_chats(tmp_path / "c.jsonl", arithmetic_chats(2))
    with pytest.raises(ConfigError, match="need a chat template"):
        build_chat_datasets(path, BYTES, None, 64)


def _settings(data, **changes) -> TrainSettings:
    base = dict(
        model="tiny",
        model_overrides={"max_seq_len": 160},
        dtype="float64",
        global_batch=8,
        micro_batch=2,
        steps=4,
        lr=3e-3,
        warmup=1,
        samples=0,
        progress=False,
        data=str(data),
        tokenizer="bytes",
    )
    return TrainSettings(**{**base, **changes})


def _one_step(settings, comm):
    """The first step's loss and the parameters it left (AdamW's step is a function of the gradients)."""
    trainer = Trainer(settings, comm)
    loss = trainer.train_step()["loss"]
    return loss, {name: p.data.copy() for name, p in trainer.params.items()}


def test_user_turns_after_the_last_reply_change_nothing_and_earlier_ones_condition_it(tmp_path):
    """A user turn after the last assistant turn is input no learned token sees and targets that are
    masked: loss and step stay exactly as they were. A change to the question before the answer
    changes the loss: the inputs still condition the assistant's tokens."""
    chats = arithmetic_chats(8)
    trailing = [
        {"messages": c["messages"] + [{"role": "user", "content": "thanks! " * (i + 1)}]} for i, c in enumerate(chats)
    ]
    asked = [
        {
            "messages": [
                c["messages"][0],
                {"role": "user", "content": "9" + c["messages"][1]["content"]},
                c["messages"][2],
            ]
        }
        for c in chats
    ]
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    results = {
        name: _one_step(
            _settings(
                write_chats(tmp_path / f"{name}.jsonl", data), seq_len=128, chat_template=str(tmp_path / "chat.jinja")
            ),
            self_comm(),
        )
        for name, data in (("plain", chats), ("trailing", trailing), ("asked", asked))
    }
    (loss, params), (trailing_loss, trailing_params) = results["plain"], results["trailing"]
    assert trailing_loss == loss and all(np.array_equal(params[k], trailing_params[k]) for k in params)
    assert abs(results["asked"][0] - loss) > 1e-6 * loss


@pytest.mark.mpi(min_size=4)
def test_tp2_dp2_fine_tuning_equals_one_process(tmp_path):
    comm = world()
    if comm.size != 4:
        pytest.skip("a tp=2 x dp=2 layout takes exactly 4 ranks")
    folder = comm.bcast_object(str(tmp_path))
    if comm.rank == 0:
        write_chats(tmp_path / "c.jsonl", arithmetic_chats(24))
        (tmp_path / "chat.jinja").write_text(TEMPLATE)
    comm.barrier()
    settings = dict(chat_template=f"{folder}/chat.jinja", steps=3, eval_split=0.25, eval_every=1)
    alone = Trainer(_settings(f"{folder}/c.jsonl", **settings), self_comm()).run()
    both = Trainer(_settings(f"{folder}/c.jsonl", **settings, tp=2, dp=2), comm).run()
    for one, other in zip(alone.records, both.records):
        assert abs(one["loss"] - other["loss"]) < 1e-9 * abs(one["loss"])
        assert abs(one.get("heldout_loss", 1) - other.get("heldout_loss", 1)) < 1e-9
    assert abs(alone.heldout_loss - both.heldout_loss) < 1e-9 * alone.heldout_loss


def test_a_chat_dataset_made_from_the_demo_task_is_learned(tmp_path):
    """Its held-out assistant-token loss falls well below where it started."""
    write_chats(tmp_path / "c.jsonl", arithmetic_chats(400))
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    settings = _settings(
        tmp_path / "c.jsonl",
        chat_template=str(tmp_path / "chat.jinja"),
        dtype="float32",
        steps=60,
        lr=3e-3,
        warmup=5,
        global_batch=16,
        micro_batch=16,
        eval_split=0.1,
        eval_every=20,
    )
    trainer = Trainer(settings, self_comm())
    start = trainer.heldout_loss()
    result = trainer.run()
    during = [r["heldout_loss"] for r in result.records if "heldout_loss" in r]
    assert len(during) == 2 and result.heldout_loss < 0.5 * start, (start, during, result.heldout_loss)
