"""`priority` through the real server and the official client: under --scheduling-policy
priority an urgent chat request preempts a running batch-priority stream (one sequence
at a time here) and answers before it ends, the stream then finishes with the text it
has alone; an API key's default and ceiling apply (--api-key-priority), the gauge counts
requests by priority; under fcfs a priority other than 0 is a 400 naming it."""

import threading
import time

import httpx
import openai
import pytest

from tests.factories import start_server

pytestmark = pytest.mark.slow

BATCH, CHAT = "key-batch", "key-chat"
STORY = {"prompt": "Once upon a time", "max_tokens": 160, "temperature": 0}


def by_priority(url: str) -> dict[tuple[str, str], float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("kvserve_requests_by_priority{"):
            labels = dict(
                kv.split("=") for kv in line[line.index("{") + 1 : line.index("}")].split(",")
            )
            out[labels["priority"].strip('"'), labels["state"].strip('"')] = float(line.split()[-1])
    return out


def test_an_urgent_request_preempts_a_batch_stream_and_keys_carry_priorities(tmp_path) -> None:
    server = start_server(
        str(tmp_path), "--scheduling-policy", "priority", "--max-num-seqs", "1",
        "--api-keys", f"{BATCH},{CHAT}", "--api-key-priority", f"{BATCH}=10:5",
    )  # fmt: skip
    try:
        batch = openai.OpenAI(base_url=server.url + "/v1", api_key=BATCH, max_retries=0)
        chat = openai.OpenAI(base_url=server.url + "/v1", api_key=CHAT, max_retries=0)
        model = batch.models.list().data[0].id
        alone = batch.completions.create(model=model, extra_body={"ignore_eos": True}, **STORY)
        with pytest.raises(openai.BadRequestError) as refused:
            batch.completions.create(
                model=model, prompt="x", max_tokens=1, extra_body={"priority": 1}
            )
        assert refused.value.body["param"] == "priority" and "5" in refused.value.body["message"]

        stream = batch.completions.create(
            model=model, stream=True, extra_body={"ignore_eos": True}, **STORY
        )
        pieces = [next(stream).choices[0].text]  # running, at its key's default 10
        assert by_priority(server.url).get(("10", "running")) == 1
        answered: list[float] = []

        def urgent() -> None:
            chat.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                extra_body={"priority": 0, "ignore_eos": True},
            )  # fmt: skip
            answered.append(time.perf_counter())

        asker = threading.Thread(target=urgent)
        asker.start()
        pieces += [c.choices[0].text for c in stream]
        ended = time.perf_counter()
        asker.join()
        assert answered and answered[0] < ended  # it did not wait for the stream's end
        assert "".join(pieces) == alone.choices[0].text  # preempted, recomputed, the same
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        preempted = [
            ln for ln in metrics.splitlines() if ln.startswith("kvserve_preemptions_total")
        ]
        assert float(preempted[0].split()[-1]) >= 1
    finally:
        server.stop()


def test_under_fcfs_a_priority_other_than_zero_is_refused_naming_it(tmp_path) -> None:
    server = start_server(str(tmp_path))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                extra_body={"priority": 3},
            )  # fmt: skip
        assert refused.value.body["param"] == "priority" and "fcfs" in refused.value.body["message"]
        ok = client.completions.create(
            model=model, prompt="hi", max_tokens=2, extra_body={"priority": 0}
        )
        assert ok.choices[0].text is not None
    finally:
        server.stop()
