"""Gemma 3 (text) from a Hugging Face folder and from a GGUF file, both written here with random
weights: the converted model gives the logits of a plain-numpy forward pass written from the published
architecture (float64) at tp = 1, 2 and 4 (one kv head: replicated at tp > 1), and export writes the
Hugging Face folder back. Where torch and transformers are importable, a tiny Gemma3ForCausalLM of
transformers' own gives the same logits, and loads what export writes."""

import json

import numpy as np
import pytest
from safetensors import safe_open
from test_convert import IDS, attention, convert_on_rank0, rel_err, tp_logits, write_hf
from test_convert import rope as rotate

from hpc_tp.cli import main

mpi = pytest.mark.mpi(min_size=1)
VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 50, 16, 3, 4, 1, 12, 24


def gemma3_source(seed=0, softcap=3.0, rope_parameters=False):
    """Three layers, the last global (sliding_window_pattern 3), a window of 3 positions over
    sequences of 6, a local rope base apart from the global one (which alone is scaled); with
    ``rope_parameters`` the rope settings per layer type, as transformers 5 writes them."""
    rng = np.random.default_rng(seed)
    config = {
        "model_type": "gemma3_text",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 32,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_theta": 1000.0,
        "rope_local_base_freq": 20.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "sliding_window": 3,
        "sliding_window_pattern": 3,
        "query_pre_attn_scalar": 10,
        "final_logit_softcapping": softcap,
        "attn_logit_softcapping": None,
        "tie_word_embeddings": True,
    }
    if rope_parameters:
        config["rope_parameters"] = {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": config.pop("rope_theta")},
            "sliding_attention": {"rope_type": "default", "rope_theta": config.pop("rope_local_base_freq")},
        }
        config["rope_theta"], config["rope_local_base_freq"] = 1.0, 1.0  # stale keys the parameters override
    t = {
        "model.embed_tokens.weight": rng.normal(0, 0.5, (VOCAB, HIDDEN)),
        "model.norm.weight": rng.normal(0, 0.2, HIDDEN),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            t[p + name + ".weight"] = rng.normal(0, 0.2, HIDDEN)
        for name in ("q_norm", "k_norm"):
            t[p + f"self_attn.{name}.weight"] = rng.normal(0, 0.2, HEAD_DIM)
        for name, shape in (
            ("self_attn.q_proj", (HEADS * HEAD_DIM, HIDDEN)),
            ("self_attn.k_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
            ("self_attn.v_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
            ("self_attn.o_proj", (HIDDEN, HEADS * HEAD_DIM)),
            ("mlp.gate_proj", (FFN, HIDDEN)),
            ("mlp.up_proj", (FFN, HIDDEN)),
            ("mlp.down_proj", (HIDDEN, FFN)),
        ):
            t[p + name + ".weight"] = rng.normal(0, 0.3, shape)
    return config, t


def gemma_norm(x, w, eps):
    """Gemma's RMSNorm: x / rms(x) * (1 + w)."""
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + w)


def per_head_norm(x, w, heads, eps):
    b, t, _ = x.shape
    return gemma_norm(x.reshape(b, t, heads, -1), w, eps).reshape(b, t, -1)


def gemma3_reference(config, t, ids):
    """Gemma 3 as published: embeddings x sqrt(hidden); per layer x += post_norm(attn(pre_norm(x))),
    x += post_norm(mlp(pre_norm(x))), q/k RMS-normed per head before RoPE, queries scaled by
    query_pre_attn_scalar^-1/2, every sliding_window_pattern-th layer global (rope_theta, scaled), the
    others local (a window, rope_local_base_freq); GeGLU (tanh); tied head; soft-capped logits."""
    eps, heads, kv, d = config["rms_norm_eps"], HEADS, KV_HEADS, config["head_dim"]
    gelu = lambda z: 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))  # noqa: E731
    x = t["model.embed_tokens.weight"][ids] * np.sqrt(config["hidden_size"])
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w = lambda name: t[p + name + ".weight"]  # noqa: E731
        local = (i + 1) % config["sliding_window_pattern"] != 0
        rope = config.get("rope_parameters")
        theta = rope and rope["sliding_attention" if local else "full_attention"]["rope_theta"]
        theta = theta or (config["rope_local_base_freq"] if local else config["rope_theta"])
        factor = 1.0 if local else config["rope_scaling"]["factor"]
        a = gemma_norm(x, w("input_layernorm"), eps)
        q = rotate(per_head_norm(a @ w("self_attn.q_proj").T, w("self_attn.q_norm"), heads, eps), heads, theta, factor)
        k = rotate(per_head_norm(a @ w("self_attn.k_proj").T, w("self_attn.k_norm"), kv, eps), kv, theta, factor)
        q = q * np.sqrt(d) / np.sqrt(config["query_pre_attn_scalar"])  # ``attention`` divides by sqrt(d)
        o = attention(q, k, a @ w("self_attn.v_proj").T, heads, kv, window=config["sliding_window"] if local else None)
        x = x + gemma_norm(o @ w("self_attn.o_proj").T, w("post_attention_layernorm"), eps)
        m = gemma_norm(x, w("pre_feedforward_layernorm"), eps)
        mlp = (gelu(m @ w("mlp.gate_proj").T) * (m @ w("mlp.up_proj").T)) @ w("mlp.down_proj").T
        x = x + gemma_norm(mlp, w("post_feedforward_layernorm"), eps)
    logits = gemma_norm(x, t["model.norm.weight"], eps) @ t["model.embed_tokens.weight"].T
    cap = config["final_logit_softcapping"]
    return cap * np.tanh(logits / cap) if cap else logits


@mpi
@pytest.mark.parametrize("softcap, rope_parameters", [(3.0, False), (None, True)])
def test_gemma3_folder_logits_match_reference_at_every_tp_and_export_back(
    shared_dir, comm_world, softcap, rope_parameters
):
    config, tensors = gemma3_source(softcap=softcap, rope_parameters=rope_parameters)
    reference = gemma3_reference(config, tensors, IDS)
    convert_on_rank0(lambda: write_hf(shared_dir / "hf", config, tensors), shared_dir / "ckpt", comm_world)
    assert rel_err(tp_logits(shared_dir / "ckpt", comm_world), reference) < 1e-10
    if comm_world.rank == 0:  # and back: Gemma's weights (the norms' 1 + w undone) under Gemma's names
        assert main(["export", str(shared_dir / "ckpt"), "-o", str(shared_dir / "out")]) == 0
        written = json.loads((shared_dir / "out" / "config.json").read_text())
        assert written["model_type"] == "gemma3_text" and written["layer_types"][1:] == [
            "sliding_attention",
            "full_attention",
        ]
        assert written["final_logit_softcapping"] == softcap and written["query_pre_attn_scalar"] == 10
        with safe_open(str(shared_dir / "out" / "model.safetensors"), "np") as f:
            assert sorted(f.keys()) == sorted(tensors)
            for name, value in tensors.items():
                assert np.abs(f.get_tensor(name) - value).max() <= 1e-15, name
    comm_world.barrier()


@mpi
@pytest.mark.parametrize("prefix", ["language_model.model.", "model.language_model."])
def test_a_multimodal_gemma3_folders_language_model_is_imported(shared_dir, comm_world, prefix):
    """A ``gemma3`` folder (4B and up) holds the language model under ``text_config`` and its weights
    under transformers 4's or 5's prefix, beside a vision tower that is left out."""
    text, tensors = gemma3_source()
    config = {"model_type": "gemma3", "text_config": text, "vision_config": {"model_type": "siglip_vision_model"}}
    renamed = {prefix + name.removeprefix("model."): value for name, value in tensors.items()}
    renamed["vision_tower.vision_model.embeddings.patch_embedding.weight"] = np.ones((4, 3, 2, 2))
    convert_on_rank0(lambda: write_hf(shared_dir / "hf", config, renamed), shared_dir / "ckpt", comm_world)
    assert rel_err(tp_logits(shared_dir / "ckpt", comm_world), gemma3_reference(text, tensors, IDS)) < 1e-10


GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_gemma3_gguf(path, config, tensors):
    """A gemma3 GGUF as llama.cpp's converter writes one: norms stored as 1 + w, float32, the sliding
    layers as a flag per layer. Returns the weights it holds (Gemma's w, through float32)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_float32("gemma3.rope.freq_base_swa", config["rope_local_base_freq"])
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(config["rope_scaling"]["factor"])
    w.add_sliding_window(config["sliding_window"])
    pattern = config["sliding_window_pattern"]
    w.add_sliding_window_pattern([(i + 1) % pattern != 0 for i in range(config["num_hidden_layers"])])
    held = {}
    for name, value in tensors.items():
        data = (value + 1.0 if "norm" in name else value).astype(np.float32)
        held[name] = data.astype(np.float64) - (1.0 if "norm" in name else 0.0)
        gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}.get(
            name
        )
        if gguf_name is None:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"
        w.add_tensor(gguf_name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


@mpi
def test_gemma3_gguf_logits_match_reference_at_every_tp(shared_dir, comm_world):
    """llama.cpp's gemma3 file: its norms' 1 + w kept as they are, queries scaled by head_dim^-1/2 (the
    file has no query_pre_attn_scalar), the local layers' own rope base and window."""
    config, tensors = gemma3_source(softcap=None)
    config = {**config, "query_pre_attn_scalar": HEAD_DIM}
    path = shared_dir / "gemma3.gguf"
    held = comm_world.bcast_object(write_gemma3_gguf(path, config, tensors) if comm_world.rank == 0 else None)
    convert_on_rank0(lambda: path, shared_dir / "ckpt", comm_world)
    assert rel_err(tp_logits(shared_dir / "ckpt", comm_world), gemma3_reference(config, held, IDS)) < 1e-10


def test_gemma3_logits_match_transformers_and_export_loads_there(tmp_path):
    """transformers' Gemma3ForCausalLM (float64, eager attention) with random weights, saved as it saves
    models: converted, the same logits to 1e-5 of the largest (transformers computes Gemma's norms and
    rotary tables in float32); exported back and loaded by transformers, the same logits again."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from hpc_tp.checkpoint import convert
    from hpc_tp.checkpoint.importers.source import open_source
    from hpc_tp.comm.mpi import self_comm

    torch.manual_seed(0)
    hf_config = transformers.Gemma3TextConfig(
        **{k: v for k, v in gemma3_source()[0].items() if k not in ("model_type", "sliding_window_pattern")},
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        attn_implementation="eager",
    )
    model = transformers.Gemma3ForCausalLM(hf_config).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if "norm" in name else 0.3))
        want = model(torch.tensor(IDS)).logits.numpy()
    model.save_pretrained(tmp_path / "hf")
    convert.replace_folder(
        tmp_path / "ckpt", False, lambda temp: convert.write_checkpoint(open_source(tmp_path / "hf"), temp)
    )
    got = tp_logits(tmp_path / "ckpt", self_comm())
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert main(["export", str(tmp_path / "ckpt"), "-o", str(tmp_path / "out")]) == 0
    exported = transformers.Gemma3ForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.float64, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        again = exported(torch.tensor(IDS)).logits.numpy()
    assert np.abs(again - want).max() <= 1e-12 * np.abs(want).max()


# Gemma 3's chat template as its tokenizer_config.json publishes it: a system message joins the first
# user turn, roles must alternate, the assistant is "model", every turn ends with <end_of_turn>.
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""


def test_gemma3_chat_template_comes_with_the_checkpoint_and_ends_turns(tmp_path):
    """A Gemma 3 folder's chat template and special tokens reach the checkpoint: the system message
    joins the first user turn, a reply stops at <end_of_turn> (besides <eos>), and a conversation
    whose roles do not alternate is the template's one-line refusal."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    from hpc_tp.errors import ConfigError
    from hpc_tp.serve.chat import stop_at_end_of_turn, template_for
    from hpc_tp.tokenizer import load_tokenizer_dir

    config, tensors = gemma3_source()
    source = write_hf(tmp_path / "hf", config, tensors)
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "Hi": 1, "Be": 2, "brief": 3}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.save(str(source / "tokenizer.json"))
    settings = {"chat_template": GEMMA3_TEMPLATE, "bos_token": "<bos>", "eos_token": "<eos>"}
    (source / "tokenizer_config.json").write_text(json.dumps(settings))
    assert main(["convert", str(source), "-o", str(tmp_path / "ckpt")]) == 0
    ours = load_tokenizer_dir(tmp_path / "ckpt" / "step-000000")
    template = template_for(ours)
    messages = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}]
    assert template.render(messages) == "<bos><start_of_turn>user\nBe brief\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    stop_at_end_of_turn(ours, template)
    assert {tokenizer.token_to_id("<end_of_turn>"), tokenizer.token_to_id("<eos>")} <= ours.stop_ids
    with pytest.raises(ConfigError, match="Conversation roles must alternate"):
        template.render([{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hi"}])
