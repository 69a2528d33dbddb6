"""`hpc-tp serve` of a BERT checkpoint answers OpenAI's /v1/embeddings (through the official client,
float and base64) with `hpc-tp embed`'s vectors, batched over tp = 2; it refuses completions in one
line, as a decoder's server refuses embeddings (tests/test_openai_client.py)."""

import urllib.request

import numpy as np
import openai
import pytest
from openai.types import CreateEmbeddingResponse
from test_bert import WORDS, converted, pooled_reference
from test_serve import serving

from hpc_tp.comm.mpi import self_comm


def test_an_encoder_serves_embeddings_and_refuses_completions(tmp_path):
    ckpt, tensors = converted(tmp_path, self_comm())
    with serving("--ckpt", str(ckpt), "--dtype", "float64", "--max-batch", "3") as served:
        port = served.port
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        texts = ["w1 w2 w3 w4 w5", "w7", "w9 w9 w40", "w3 w2"]
        rows = [[2] + [WORDS.index(w) for w in t.split()] + [3] for t in texts]
        raw = client.embeddings.with_raw_response.create(model="ckpt", input=texts, encoding_format="float")
        answer = CreateEmbeddingResponse.model_validate(raw.http_response.json())
        assert [d.index for d in answer.data] == [0, 1, 2, 3]  # 4 inputs over batches of 3
        for data, row in zip(answer.data, rows):
            assert float(np.abs(np.array(data.embedding) - pooled_reference(tensors, row)).max()) < 1e-9
        assert answer.usage.prompt_tokens == sum(len(r) for r in rows)
        packed = client.embeddings.create(model="ckpt", input=[[2, 44, 3], [2, 5, 3]])  # the client asks base64
        for data, row in zip(packed.data, [[2, 44, 3], [2, 5, 3]]):
            assert float(np.abs(np.array(data.embedding) - pooled_reference(tensors, row)).max()) < 1e-6  # float32
        with pytest.raises(openai.BadRequestError, match="input\\[0\\]: .*expected 1 to max_seq_len"):
            client.embeddings.create(model="ckpt", input=" ".join(["w5"] * 30))
        with pytest.raises(
            openai.BadRequestError,
            match="serves an encoder \\(bert\\) checkpoint: it answers /v1/embeddings, not /v1/completions",
        ):
            client.completions.create(model="ckpt", prompt="w1")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as response:
            counted = dict(
                line.rsplit(" ", 1) for line in response.read().decode().splitlines() if not line.startswith("#")
            )
        assert counted['hpc_tp_requests_total{finish_reason="embedding"}'] == "2"
        assert counted["hpc_tp_requests_running"] == "0"
