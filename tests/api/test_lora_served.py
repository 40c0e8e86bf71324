"""LoRA adapters served (--lora-modules): /v1/models lists each adapter with the model as
its parent, the official client selects one by `model` in completions, chat and
Responses, its greedy text is the peft library's model's (adapter applied, not merged,
float32), requests of several adapters and the base model running together get the
text each gets alone, and a model that is neither is a 404 naming what is served."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch
import transformers as tf

from model.tokenizer import Tokenizer
from tests.factories import start_server, write_adapter, write_llama, write_tokenizer

pytestmark = pytest.mark.slow

ADAPTERS = {  # name: (seed, peft's LoraConfig)
    "sql": (1, dict(r=8, lora_alpha=16, target_modules="all-linear")),
    "style": (2, dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"])),
}
PROMPTS = ["the quick brown fox", "a lazy dog sleeps", "over the hills"]
NEW = 8


@torch.no_grad()
def _greedy(model, ids: list[int]) -> list[int]:
    x = torch.tensor([ids])
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=NEW,
                         do_sample=False)  # fmt: skip
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("process", ["off", "on"])  # the engine in the front, or apart
def test_adapters_are_listed_selected_by_model_and_give_peft_models_text(
    process: str, tmp_path: Path
) -> None:
    base = tmp_path / "base"
    write_llama(base, tied=False)
    write_tokenizer(base)
    tokenizer = Tokenizer.from_dir(base)
    want: dict[str, list[str]] = {}
    for name, (seed, config) in ADAPTERS.items():
        hf = tf.LlamaForCausalLM.from_pretrained(base).eval()
        peft_model = write_adapter(hf, tmp_path / name, seed, **config)
        want[name] = [tokenizer.decode(_greedy(peft_model, tokenizer.encode(p))) for p in PROMPTS]
        with peft_model.disable_adapter():
            want["base"] = [
                tokenizer.decode(_greedy(peft_model, tokenizer.encode(p))) for p in PROMPTS
            ]
    modules = ",".join(f"{n}={tmp_path / n}" for n in ADAPTERS)
    server = start_server(str(tmp_path), "--model", str(base), "--dtype", "float32",
                          "--lora-modules", modules, "--max-lora-rank", "8",
                          "--engine-process", process)  # fmt: skip
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        listed = {m.id: m.model_extra.get("parent") for m in client.models.list().data}
        assert listed == {"base": None, "sql": "base", "style": "base"}
        assert client.models.retrieve("sql").model_extra["parent"] == "base"

        def complete(job: tuple[str, int]) -> tuple[str, str]:
            model, i = job
            r = client.completions.create(
                model=model, prompt=PROMPTS[i], max_tokens=NEW, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            return r.model, r.choices[0].text

        jobs = [(m, i) for m in ("base", *ADAPTERS) for i in range(len(PROMPTS))]
        alone = [complete(job) for job in jobs]
        assert alone == [(m, want[m][i]) for m, i in jobs]
        assert want["sql"] != want["base"] and want["style"] != want["base"]
        with ThreadPoolExecutor(len(jobs)) as pool:
            assert list(pool.map(complete, jobs)) == alone
        chat = client.chat.completions.create(
            model="style", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        )  # fmt: skip
        assert chat.model == "style" and chat.usage.completion_tokens == 4
        response = client.responses.create(model="sql", input="hi", max_output_tokens=4)
        assert response.model == "sql" and response.usage.output_tokens == 4
        with pytest.raises(openai.NotFoundError) as info:
            client.completions.create(model="other", prompt="x", max_tokens=1)
        error = info.value.body
        assert error["code"] == "model_not_found" and "'base', 'sql', 'style'" in error["message"]
    finally:
        server.stop()
