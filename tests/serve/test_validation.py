"""Each invalid request gets a 400 naming the field; concurrent good requests finish."""

from __future__ import annotations

import anyio
import httpx
import pytest

from .conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]

# (endpoint, body without model, the field the error must name)
INVALID = [
    (CHAT, {"messages": MESSAGES, "temperature": -1}, "temperature"),
    (CHAT, {"messages": MESSAGES, "temperature": "hot"}, "temperature"),
    (CHAT, {"messages": MESSAGES, "top_p": 0}, "top_p"),
    (CHAT, {"messages": MESSAGES, "top_p": 1.5}, "top_p"),
    (CHAT, {"messages": MESSAGES, "top_k": 2.5}, "top_k"),
    (CHAT, {"messages": MESSAGES, "min_p": 2}, "min_p"),
    (CHAT, {"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    (CHAT, {"messages": MESSAGES, "max_tokens": "10"}, "max_tokens"),
    (CHAT, {"messages": MESSAGES, "seed": -3}, "seed"),
    (CHAT, {"messages": MESSAGES, "n": 2}, "n"),
    (CHAT, {"messages": MESSAGES, "stop": [""]}, "stop"),
    (CHAT, {"messages": MESSAGES, "stream": "yes"}, "stream"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 600}]}, "messages"),
    (CHAT, {"messages": MESSAGES, "model": "gpt-4"}, "model"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [5, 99999]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x" * (2 << 20)}, "body"),
]


@pytest.fixture(scope="module")
def model_id(server):
    return httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"][0]["id"]


async def test_invalid_requests_get_400_naming_the_field(server, model_id):
    good, bad = [], {}

    async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as http:
        async def good_one(i):
            body = {"model": model_id, "prompt": "The quick brown fox", "max_tokens": 24,
                    "ignore_eos": True, "temperature": 0.5, "seed": i}
            good.append((await http.post("/v1/completions", json=body)).json())

        async def bad_one(i):
            path, body, _ = INVALID[i]
            bad[i] = await http.post(path, json={"model": model_id, **body})

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(good_one, i)
            for i in range(len(INVALID)):
                tg.start_soon(bad_one, i)
        not_json = await http.post(CHAT, content=b"{nope", headers={"content-type": "x"})
    for i, response in bad.items():
        field = INVALID[i][2]
        assert response.status_code == 400, (field, response.text)
        error = response.json()["error"]
        assert error["param"] == field, (field, error)
        assert error["type"] == "invalid_request_error"
        assert field.split("[")[0] in error["message"]
    assert not_json.status_code == 400 and not_json.json()["error"]["param"] == "body"
    assert len(good) == 8
    assert all(g["choices"][0]["finish_reason"] == "length" for g in good)
    assert all(g["usage"]["completion_tokens"] == 24 for g in good)
