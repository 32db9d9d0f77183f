"""The official `openai` client against a live `specloop serve`."""

from __future__ import annotations

import json
import subprocess
import sys

import anyio
import httpx
import pytest

from .conftest import API_KEY, ENV, K, MAX_BATCH, metrics

PROMPT = "The quick brown fox"


@pytest.fixture
async def client(server):
    # Closed after the test: an unclosed client leaks its sockets (ResourceWarning).
    import openai  # noqa: PLC0415 (~1 s to import: not at collection)
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY,
                                  max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def model_id(server):
    models = httpx.get(f"{server.url}/v1/models",
                       headers={"Authorization": f"Bearer {API_KEY}"}).json()
    return models["data"][0]["id"]


async def chat(client, model_id, stream=False, **kw):
    kw.setdefault("max_tokens", 24)
    kw.setdefault("extra_body", {})["return_token_ids"] = True
    return await client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": PROMPT}], stream=stream, **kw)


async def joined_stream(client, model_id, **kw):
    text, ids, reason, usage = "", [], None, None
    stream = await chat(client, model_id, stream=True,
                        stream_options={"include_usage": True}, **kw)
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            ids += getattr(choice, "token_ids", None) or []
            reason = choice.finish_reason or reason
    return text, ids, reason, usage


def test_greedy_chat_equals_specloop_generate(server, serve_config, model_id):
    proc = subprocess.run(
        [sys.executable, "-m", "specloop.engine.cli", "generate", "--config", serve_config,
         "--prompt", PROMPT, "--max-tokens", "24", "--ignore-eos", "--json"],
        capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 0, proc.stderr
    reference = json.loads(proc.stdout.splitlines()[0])

    async def main():
        import openai  # noqa: PLC0415 (~1 s to import: not at collection)
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY) as client:
            # Other requests in the batch must not change a greedy one.
            async with anyio.create_task_group() as tg:
                for t in (0.7, 1.0):
                    tg.start_soon(lambda t=t: chat(client, model_id, temperature=t,
                                                   max_tokens=40))
                reply = await chat(client, model_id, temperature=0,
                                   extra_body={"ignore_eos": True})
        return reply

    reply = anyio.run(main)
    choice = reply.choices[0]
    assert choice.token_ids == reference["token_ids"]
    assert choice.message.content == reference["text"]
    assert reply.usage.completion_tokens == 24
    spec = reply.usage.spec_decode
    assert spec["num_draft_tokens"] == spec["num_drafts"] * K
    assert sum(spec["accepted_per_position"]) == spec["num_accepted_tokens"]
    assert 1 <= spec["mean_acceptance_length"] <= K + 1


@pytest.mark.parametrize("params", [{"temperature": 0},
                                    {"temperature": 0.9, "top_p": 0.9, "seed": 5}])
async def test_stream_deltas_join_to_the_full_text(client, model_id, params):
    full = await chat(client, model_id, **params)
    text, ids, reason, usage = await joined_stream(client, model_id, **params)
    assert text == full.choices[0].message.content
    assert ids == full.choices[0].token_ids
    assert reason == full.choices[0].finish_reason
    assert usage.completion_tokens == len(ids) == full.usage.completion_tokens


async def test_seeded_sampled_requests_repeat(client, model_id):
    params = dict(temperature=1.0, top_p=0.95, seed=1234, max_tokens=32,
                  extra_body={"top_k": 50, "min_p": 0.01, "ignore_eos": True})
    results = []

    async def one(i):
        results.append((i, (await chat(client, model_id, **params)).choices[0].token_ids))

    async with anyio.create_task_group() as tg:     # concurrently: different batches
        for i in range(4):
            tg.start_soon(one, i)
    alone = (await chat(client, model_id, **params)).choices[0].token_ids
    assert all(ids == alone for _, ids in results)
    other = await chat(client, model_id, **{**params, "seed": 4321})
    assert other.choices[0].token_ids != alone


async def test_completions_with_stop_string_and_stop_token(client, model_id):
    base = await client.completions.create(model=model_id, prompt=PROMPT, max_tokens=30,
                                           temperature=0, extra_body={"ignore_eos": True,
                                                                      "return_token_ids": True})
    text, ids = base.choices[0].text, base.choices[0].token_ids
    stop = text[6:9]
    cut = await client.completions.create(model=model_id, prompt=PROMPT, max_tokens=30,
                                          temperature=0, stop=[stop],
                                          extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[:text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    by_id = await client.completions.create(
        model=model_id, prompt=PROMPT, max_tokens=30, temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [ids[4]],
                    "return_token_ids": True})
    assert by_id.choices[0].token_ids == ids[:ids.index(ids[4]) + 1]
    assert by_id.choices[0].finish_reason == "stop"


async def test_models_health_auth_and_metrics(server, model_id):
    async with httpx.AsyncClient(base_url=server.url) as http:
        assert (await http.get("/health")).json() == {"status": "ok"}
        denied = await http.get("/v1/models")
        assert denied.status_code == 401
        assert denied.json()["error"]["type"] == "authentication_error"
        wrong = await http.post("/v1/completions", json={"prompt": "x"},
                                headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
    import openai  # noqa: PLC0415 (~1 s to import: not at collection)
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY) as client:
        assert [m.id for m in (await client.models.list()).data] == [model_id]
        # One request of its own: the iteration metrics below exist once an iteration
        # ran, which must not hang on another test having run first on this server.
        await client.completions.create(model=model_id, prompt=PROMPT, max_tokens=4)
    m = metrics(server.url)
    assert m["specloop:kv_slots_free"] == MAX_BATCH
    for pos in range(K):
        assert f"specloop:spec_decode_num_accepted_tokens_per_pos_total{{position={pos}}}" in m
    assert any(key.startswith("specloop:iteration_state_duration_seconds_count{state=VERIFY")
               for key in m)
