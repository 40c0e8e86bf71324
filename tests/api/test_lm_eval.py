"""lm-evaluation-harness's `local-completions` model against a live server: a small
multiple-choice task (a local JSON file, no download) runs end to end on `echo` with
`logprobs`, and every loglikelihood it reports is a full forward's sum over the
continuation's tokens."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.weights import load_model
from tests.factories import start_server, write_llama, write_tokenizer

pytestmark = pytest.mark.slow

ROWS = [
    {"question": "The capital of France is", "choices": ["Paris", "Rome", "a dog"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["four", "five"], "answer": 0},
    {"question": "Water is", "choices": ["wet", "dry and hot"], "answer": 0},
]


def task_dir(tmp_path: Path) -> Path:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny.yaml").write_text(
        "task: kvserve_tiny\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return tasks


def test_local_completions_loglikelihoods_are_a_full_forwards(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    ckpt = tmp_path / "ckpt"
    write_llama(ckpt, tied=False)
    write_tokenizer(ckpt)
    tasks, out = task_dir(tmp_path), tmp_path / "out"
    server = start_server(str(tmp_path), "--model", str(ckpt), "--dtype", "float32")
    try:
        args = (
            f"model=ckpt,base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={ckpt},num_concurrent=2,max_retries=1"
        )
        run = subprocess.run(
            [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
             args, "--tasks", "kvserve_tiny", "--include_path", str(tasks), "--output_path",
             str(out), "--log_samples"],
            capture_output=True, text=True, timeout=600,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
        )  # fmt: skip
    finally:
        server.stop()
    assert run.returncode == 0, run.stderr[-3000:]
    [samples] = list(out.rglob("samples_kvserve_tiny_*.jsonl"))
    docs = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(docs) == len(ROWS)
    tok = AutoTokenizer.from_pretrained(str(ckpt))  # what lm-eval encoded with
    model = load_model(ckpt, torch.float32)
    scored = 0
    for doc in docs:
        for arg, resp in zip(doc["arguments"].values(), doc["resps"], strict=True):
            context, continuation = arg["arg_0"], arg["arg_1"]
            whole = tok.encode(context + continuation, add_special_tokens=False)
            first = len(tok.encode(context, add_special_tokens=False))
            with torch.inference_mode():
                lp = torch.log_softmax(model(torch.tensor(whole)).float(), dim=-1)
            want = sum(lp[i - 1, whole[i]].item() for i in range(first, len(whole)))
            greedy = all(int(lp[i - 1].argmax()) == whole[i] for i in range(first, len(whole)))
            got, got_greedy = resp[0]
            assert abs(float(got) - want) <= 1e-3, (context, continuation, got, want)
            assert (got_greedy == "True") == greedy
            scored += 1
    assert scored == sum(len(r["choices"]) for r in ROWS)
