"""A chat reply ends at the end of the assistant's turn: the ids that stop a generation come from the
checkpoint (its tokenizer's eos, generation_config.json's list, GGUF's eos/eot ids) and from the chat
template (the token it writes after a reply), for ChatML, Llama 3 and Gemma style templates."""

from __future__ import annotations

import json

import pytest
from test_convert import gpt2_source, llama_source, write_gguf, write_hf
from test_generate import larger_weights
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from hpc_tp.cli import main
from hpc_tp.comm.mpi import self_comm
from hpc_tp.models import GPTModel, ModelConfig
from hpc_tp.serve.chat import ChatTemplate, stop_at_end_of_turn
from hpc_tp.serve.generate import Engine
from hpc_tp.serve.sampling import SamplingParams
from hpc_tp.tokenizer import HFTokenizer, load_tokenizer_dir

# Templates in the style of each family: where the turns open, the token that closes them, the
# tokenizer's own eos (another token: a reply must stop at the turn's end all the same).
FAMILIES = {
    "chatml": dict(
        source="{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        specials=["<|im_start|>", "<|im_end|>"],
        end="<|im_end|>",
        eos="<|endoftext|>",
        bos="",
    ),
    "llama3": dict(
        source="{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}",
        specials=["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        end="<|eot_id|>",
        eos="<|end_of_text|>",
        bos="<|begin_of_text|>",
    ),
    "gemma": dict(
        source="{{ bos_token }}{% for m in messages %}<start_of_turn>"
        "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] | trim }}<end_of_turn>\n"
        "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
        specials=["<start_of_turn>", "<end_of_turn>"],
        end="<end_of_turn>",
        eos="<eos>",
        bos="<bos>",
    ),
}
WORDS = ["user", "assistant", "model", "What", "is", "the", "capital", "of", "France", "?", "Paris", "."]
V = 64


def family(name: str) -> tuple[HFTokenizer, ChatTemplate, int]:
    """The family's tokenizer (words, its special tokens, filler words up to the model's vocabulary),
    its chat template and the id of its end-of-turn token."""
    f = FAMILIES[name]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]"] + WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = [t for t in (f["bos"], f["eos"], *f["specials"]) if t]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.add_tokens([f"w{i}" for i in range(V - tokenizer.get_vocab_size())])
    ours = HFTokenizer(tokenizer, {"eos_token": f["eos"]})
    return ours, ChatTemplate(f["source"], f["bos"], f["eos"]), tokenizer.token_to_id(f["end"])


@pytest.mark.parametrize("name", FAMILIES)
def test_the_token_that_closes_an_assistant_turn_is_found(name):
    tokenizer, template, end_id = family(name)
    assert template.end_of_turn_ids(tokenizer) == {end_id}
    assert end_id not in tokenizer.stop_ids  # the checkpoint's eos is another token: the template adds it
    stop_at_end_of_turn(tokenizer, template)
    assert {end_id, tokenizer.eos_id} <= tokenizer.stop_ids


def test_a_template_without_special_tokens_or_one_that_refuses_the_probe_adds_nothing():
    tokenizer, _, _ = family("chatml")
    plain = ChatTemplate("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    refusing = ChatTemplate("{{ raise_exception('no assistant turns here') }}")
    assert plain.end_of_turn_ids(tokenizer) == refusing.end_of_turn_ids(tokenizer) == frozenset()


def _untied_model(seed=4):
    cfg = ModelConfig(
        vocab_size=V,
        hidden=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=48,
        max_seq_len=64,
        norm="rmsnorm",
        activation="swiglu",
        position="rope",
        bias=False,
        tie_embeddings=False,
    )
    return larger_weights(GPTModel(cfg, self_comm(), seed=seed))


@pytest.mark.parametrize("name", FAMILIES)
def test_a_greedy_chat_stops_at_the_end_of_its_turn_and_no_template_text_follows(name):
    """The model is made to choose the end-of-turn token where it would choose a word: its head row for
    that token becomes a copy of the word's, and greedy decoding takes the lower id of a tie. It then
    writes the words before, stops with finish_reason "stop", and nothing of the template follows."""
    tokenizer, template, end_id = family(name)
    prompt = tokenizer.encode(template.render([{"role": "user", "content": "What is the capital of France ?"}]))
    model = _untied_model()
    free, _ = Engine(model, tokenizer).generate([prompt], [SamplingParams(max_new_tokens=12)])
    picks = free[0].ids
    k = next(k for k in range(1, len(picks)) if picks[k] > end_id and picks[k] not in picks[:k])
    head = dict(model.named_parameters())["head.weight"]
    rows = head.data.copy()
    rows[end_id] = rows[picks[k]]
    head.load_full(rows)
    stop_at_end_of_turn(tokenizer, template)
    out, _ = Engine(model, tokenizer).generate([prompt], [SamplingParams(max_new_tokens=12)])
    assert out[0].finish_reason == "stop" and out[0].ids == picks[:k]
    assert out[0].text == tokenizer.decode(picks[:k])
    without_the_stop, _ = Engine(model, family(name)[0]).generate([prompt], [SamplingParams(max_new_tokens=k + 3)])
    assert without_the_stop[0].ids[: k + 1] == picks[:k] + [end_id]  # what the template's stop id cut off


def test_stop_ids_come_from_the_checkpoint_and_are_kept_by_convert_and_export(tmp_path):
    """generation_config.json's eos_token_id list and tokenizer_config.json's eos_token (Hugging Face),
    eos/eot ids (GGUF): kept in the checkpoint, loaded as stop ids, written back by export."""
    config, tensors = gpt2_source()
    source = write_hf(tmp_path / "hf", config, tensors)
    vocab = {"hi": 0, "[UNK]": 1, "<|endoftext|>": 2, "<|im_end|>": 3}
    Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(str(source / "tokenizer.json"))
    (source / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (source / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3], "bos_token_id": 2}))
    assert main(["convert", str(source), "-o", str(tmp_path / "ckpt")]) == 0
    tokenizer = load_tokenizer_dir(tmp_path / "ckpt" / "step-000000")
    assert tokenizer.eos_id == 3 and tokenizer.stop_ids == {2, 3}
    assert main(["export", str(tmp_path / "ckpt"), "-o", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text()) == {"eos_token_id": [3, 2]}

    def llama3_vocab(w):
        tokens = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "\u2581", "a"]
        tokens += [f"t{i}" for i in range(44)]
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores([0.0] * 4 + [-float(i) for i in range(4, 50)])
        w.add_token_types([2, 3, 3, 3] + [1] * 46)
        w.add_eos_token_id(2)
        w.add_uint32("tokenizer.ggml.eot_token_id", 3)

    config, tensors = llama_source(hidden=32, ffn=64)
    write_gguf(tmp_path / "m.gguf", config, tensors, quantized=(), tokenizer=llama3_vocab)
    assert main(["convert", str(tmp_path / "m.gguf"), "-o", str(tmp_path / "g")]) == 0
    tokenizer = load_tokenizer_dir(tmp_path / "g" / "step-000000")
    assert tokenizer.eos_id == 2 and tokenizer.stop_ids == {2, 3}
