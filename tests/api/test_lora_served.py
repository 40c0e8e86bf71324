"""LoRA adapters served (--lora-modules): /v1/models lists each adapter with the model as
its parent, the official client selects one by `model` in completions, chat and
Responses, its greedy text is the peft library's model's (adapter applied, not merged,
float32), requests of several adapters and the base model running together get the
text each gets alone, and a model that is neither is a 404 naming what is served."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
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
        lora = client.models.retrieve("base").model_extra["memory"]["lora"]
        assert lora["max_loras"] == 4 and lora["max_lora_rank"] == 8 and lora["bank_bytes"] > 0

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
        loads = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x",
                           "lora_path": str(tmp_path / "sql")}, timeout=30)  # fmt: skip
        assert loads.status_code == 403 and "--admin-api-keys" in loads.text
    finally:
        server.stop()


def test_adapters_load_and_unload_at_run_time_with_an_admin_key(tmp_path: Path) -> None:
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: an admin key loads a
    peft adapter, which then serves peft's text; a plain key may not (403), a bad path
    or a second load is a 400 naming why, an unknown name a 404; a key limited to the
    adapter lists and uses it alone; /metrics counts its requests with the labels vLLM's
    lora_requests_info has; unloaded, it is a 404."""
    base = tmp_path / "base"
    write_llama(base, tied=False)
    write_tokenizer(base)
    tokenizer = Tokenizer.from_dir(base)
    hf = tf.LlamaForCausalLM.from_pretrained(base).eval()
    seed, config = ADAPTERS["sql"]
    want = tokenizer.decode(_greedy(write_adapter(hf, tmp_path / "sql", seed, **config),
                                    tokenizer.encode(PROMPTS[0])))  # fmt: skip
    server = start_server(str(tmp_path), "--model", str(base), "--dtype", "float32",
                          "--enable-lora", "--max-lora-rank", "8", "--api-keys", "user,limited",
                          "--admin-api-keys", "root", "--api-key-models", "limited=sql")  # fmt: skip
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:

            def change(route: str, key: str, **body: str) -> httpx.Response:
                headers = {"Authorization": f"Bearer {key}"}
                return http.post(f"/v1/{route}_lora_adapter", json=body, headers=headers)

            sql = str(tmp_path / "sql")
            assert change("load", "user", lora_name="sql", lora_path=sql).status_code == 403
            r = change("load", "root", lora_name="sql", lora_path=sql)
            assert (
                r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' added successfully."
            )
            r = change("load", "root", lora_name="sql", lora_path=sql)
            assert r.status_code == 400 and "is loaded already" in r.json()["error"]["message"]
            r = change("load", "root", lora_name="x", lora_path=str(tmp_path / "none"))
            assert r.status_code == 400 and "adapter directory not found" in r.text
            r = change("load", "root", lora_name="x", lora_path=str(base))
            assert r.status_code == 400 and "no adapter_config.json" in r.text
            r = change("load", "root", lora_name="../x", lora_path=sql)
            assert r.status_code == 400  # a name is a word: it goes into labels and lists
            user, limited = (
                openai.OpenAI(base_url=server.url + "/v1", api_key=k, max_retries=0)
                for k in ("user", "limited")
            )
            assert [m.id for m in user.models.list().data] == ["base", "sql"]
            assert [m.id for m in limited.models.list().data] == ["sql"]
            with pytest.raises(openai.NotFoundError):
                limited.completions.create(model="base", prompt="x", max_tokens=1)
            r = limited.completions.create(
                model="sql", prompt=PROMPTS[0], max_tokens=NEW, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert r.choices[0].text == want
            metrics = http.get("/metrics").text
            assert 'kvserve_lora_requests_total{adapter="sql",model="base"} 1.0' in metrics
            assert 'kvserve_lora_requests_info{max_lora="4"' in metrics
            assert change("unload", "root", lora_name="sql").status_code == 200
            assert change("unload", "root", lora_name="sql").status_code == 404
            with pytest.raises(openai.NotFoundError):
                user.completions.create(model="sql", prompt="x", max_tokens=1)
    finally:
        server.stop()
