"""`hwkv serve --model file.gguf`: the server takes its tokenizer and chat template from the GGUF
metadata; a chat request through the `openai` client equals Engine.generate on the same file."""

import openai
import pytest
from server_utils import Server

import hwkv

pytest.importorskip("gguf")
pytestmark = pytest.mark.timeout(180)


def test_chat_from_a_gguf_equals_engine(tiny_model, tmp_path):
    from hwkv.testing.gguf_models import write_tiny_gguf

    g = write_tiny_gguf(tiny_model, tmp_path / "tiny.gguf", qtype="Q8_0")
    messages = [{"role": "user", "content": "What is the capital?"}]
    local = hwkv.Engine(str(g), backend="cpu", num_kv_blocks=64)
    tok = local.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages, True), add_special_tokens=False)
    want = local.generate([ids], hwkv.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    s = Server(g, "--num-kv-blocks", "64", "--served-model-name", "tiny-gguf")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        got = client.chat.completions.create(model="tiny-gguf", messages=messages, max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True})
        assert got.choices[0].message.content == want.text
        assert got.usage.prompt_tokens == len(ids)
    finally:
        out = s.output()
        s.stop()
    assert s.proc.returncode == 0, out
