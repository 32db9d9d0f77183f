"""Many concurrent streams, some abandoned mid-way: the rest complete, slots come back, and
the metrics add up to what the responses report."""

from __future__ import annotations

import anyio

from .conftest import API_KEY, K, MAX_BATCH, metrics

PROMPTS = ["The quick brown fox", "A llama is", "def main():", "Numbers: 0 1 2 3"]
DRAFTS = "specloop:spec_decode_num_drafts_total"
DRAFT_TOKENS = "specloop:spec_decode_num_draft_tokens_total"
ACCEPTED = "specloop:spec_decode_num_accepted_tokens_total"


def per_pos(pos: int) -> str:
    return f"specloop:spec_decode_num_accepted_tokens_per_pos_total{{position={pos}}}"


def finished(reason: str) -> str:
    return f"specloop:request_success_total{{finished_reason={reason}}}"


async def _stream(client, model, i, max_tokens, leave_after=None):
    """(chunks with text, finish reason, usage); leaves after ``leave_after`` chunks."""
    stream = await client.completions.create(
        model=model, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens, stream=True,
        temperature=0 if i % 2 else 0.8, seed=i, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    chunks, reason, usage = 0, None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            chunks += 1
            reason = choice.finish_reason or reason
        if leave_after is not None and chunks >= leave_after:
            await stream.close()            # the client disconnects mid-stream
            return chunks, "left", None
    return chunks, reason, usage


async def _wait_idle(url):
    with anyio.fail_after(30):
        while True:
            m = metrics(url)
            if m["specloop:kv_slots_free"] == MAX_BATCH and \
                    m["specloop:num_requests_running"] == 0:
                return m
            await anyio.sleep(0.1)


async def test_200_streams_50_disconnected(server):
    # Closed at the end: an unclosed client leaks its sockets (ResourceWarning).
    import openai  # noqa: PLC0415 (~1 s to import: not at collection)
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                                  timeout=120) as client:
        model = (await client.models.list()).data[0].id
        before = await _wait_idle(server.url)
        results = {}

        async def one(i):
            leave = 2 if i % 4 == 0 else None          # 50 of 200 leave after two chunks
            results[i] = await _stream(client, model, i, max_tokens=400 if leave else 12,
                                       leave_after=leave)

        async with anyio.create_task_group() as tg:
            for i in range(200):
                tg.start_soon(one, i)
        stayed = [r for r in results.values() if r[1] != "left"]
        assert len(stayed) == 150 and all(r[1] == "length" for r in stayed)
        assert all(r[2].completion_tokens == 12 for r in stayed)
        after = await _wait_idle(server.url)              # every slot came back

        def delta(key):
            return after.get(key, 0) - before.get(key, 0)

        # Every request finishes once. A leaver is aborted when the server sees the
        # disconnect; on a loaded machine the client may close after the server already
        # produced all 400 tokens, and that request then finished by length (seen: 2 of 50).
        # Most leavers must still be aborted: without disconnect handling all 50 finish.
        aborted = delta(finished("abort"))
        assert delta(finished("length")) + aborted == 200
        assert 25 <= aborted <= 50
        # Abandoned requests drafted too, so the totals are at least what responses report.
        reported = [r[2].spec_decode for r in stayed]
        assert delta(DRAFTS) >= sum(s["num_drafts"] for s in reported)
        assert delta(ACCEPTED) >= sum(s["num_accepted_tokens"] for s in reported)


async def test_metrics_equal_what_responses_report(server):
    await _metrics_add_up(server)


async def test_core_process_server_serves_the_same(server, core_server):
    """``--core-process`` (the engine core in a child process): the same greedy answers
    as the in-process server, and its metrics, fed by the core's events across the pipe,
    add up to what its responses report."""
    import openai  # noqa: PLC0415

    answers = []
    for srv in (server, core_server):
        async with openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY,
                                      max_retries=0) as client:
            model = (await client.models.list()).data[0].id
            got = []
            for prompt in PROMPTS:
                done = await client.completions.create(
                    model=model, prompt=prompt, max_tokens=12, temperature=0,
                    extra_body={"ignore_eos": True})
                got.append(done.choices[0].text)
            answers.append(got)
    assert answers[0] == answers[1] and all(answers[1])
    await _metrics_add_up(core_server)


async def _metrics_add_up(server):
    # Closed at the end: an unclosed client leaks its sockets (ResourceWarning).
    import openai  # noqa: PLC0415 (~1 s to import: not at collection)
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY,
                                  max_retries=0) as client:
        model = (await client.models.list()).data[0].id
        before = await _wait_idle(server.url)
        results = []

        async def one(i):
            results.append(await _stream(client, model, i, max_tokens=10 + i))

        async with anyio.create_task_group() as tg:
            for i in range(24):
                tg.start_soon(one, i)
        after = await _wait_idle(server.url)
        spec = [r[2].spec_decode for r in results]
        assert after[DRAFTS] - before[DRAFTS] == sum(s["num_drafts"] for s in spec)
        assert after[DRAFT_TOKENS] - before[DRAFT_TOKENS] == \
            K * sum(s["num_drafts"] for s in spec)
        assert after[ACCEPTED] - before[ACCEPTED] == sum(s["num_accepted_tokens"] for s in spec)
        for pos in range(K):
            assert after[per_pos(pos)] - before[per_pos(pos)] == \
                sum(s["accepted_per_position"][pos] for s in spec)
        assert after[finished("length")] - before.get(finished("length"), 0) == 24
        generated = "specloop:generation_tokens_total"
        assert after[generated] - before[generated] == \
            sum(r[2].completion_tokens for r in results)
        # Every VERIFY counted once, by whether its step was queued ahead; on the CPU
        # none is (the chain and the step ahead run on a GPU only).
        per_k = sum(v - before.get(name, 0) for name, v in after.items()
                    if name.startswith("specloop:spec_decode_iterations_per_k_total"))
        overlapped = "specloop:iterations_overlapped_total{overlapped=%s}"
        assert after.get(overlapped % "true", 0) == before.get(overlapped % "true", 0)
        assert after[overlapped % "false"] - before.get(overlapped % "false", 0) == per_k > 0
