"""Request parsing: what reaches the scheduler, and what each malformed body is answered with."""

import json

import pytest

from pilotfish.ext_proc.openai import CHAT_COMPLETIONS, COMPLETIONS, RequestError, error_body, parse_request


def body(obj: object) -> bytes:
    return json.dumps(obj).encode()


@pytest.mark.parametrize(
    ("path", "payload", "text", "stream", "max_tokens", "include_usage"),
    [
        (COMPLETIONS, {"model": "m", "prompt": "hello"}, "hello", False, None, False),
        (COMPLETIONS, {"model": "m", "prompt": ["a", "b"], "stream": True, "max_tokens": 5}, "ab", True, 5, False),
        (COMPLETIONS, {"model": "m", "prompt": [1, 2, 3]}, "", False, None, False),
        (
            COMPLETIONS,
            {"model": "m", "prompt": "x", "stream": True, "stream_options": {"include_usage": True}},
            "x",
            True,
            None,
            True,
        ),
        (CHAT_COMPLETIONS, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "hi", False, None, False),
        (
            CHAT_COMPLETIONS,
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": [{"type": "text", "text": "q"}]},
                ],
                "max_completion_tokens": 7,
                "max_tokens": 99,
            },
            "be brief\nq",
            False,
            7,
            False,
        ),
    ],
)
def test_valid_requests(path, payload, text, stream, max_tokens, include_usage):
    parsed = parse_request(path, body(payload))
    assert (parsed.model, parsed.prompt_text, parsed.stream, parsed.max_tokens, parsed.include_usage) == (
        "m",
        text,
        stream,
        max_tokens,
        include_usage,
    )


def test_token_id_prompts_are_kept_as_ids():
    # counted and hashed as sent, so the gateway's prefix hashes match the engine's tokens
    parsed = parse_request(COMPLETIONS, body({"model": "m", "prompt": [7, 0, 4294967295]}))
    assert parsed.prompt_token_ids == [7, 0, 4294967295]
    assert parse_request(COMPLETIONS, body({"model": "m", "prompt": "7 0"})).prompt_token_ids is None
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt": [1]}
    assert parse_request(CHAT_COMPLETIONS, body(chat)).prompt_token_ids is None


@pytest.mark.parametrize(
    ("path", "raw", "fragment"),
    [
        (COMPLETIONS, b"", "empty"),
        (COMPLETIONS, b"{not json", "not valid JSON"),
        (COMPLETIONS, b"\xff\xfe{}", "UTF-8"),
        (COMPLETIONS, b"[1, 2]", "JSON object"),
        (COMPLETIONS, body({"prompt": "x"}), "'model'"),
        (COMPLETIONS, body({"model": 3, "prompt": "x"}), "'model'"),
        (COMPLETIONS, body({"model": "m"}), "'prompt'"),
        (COMPLETIONS, body({"model": "m", "prompt": [1, "a"]}), "'prompt'"),
        (COMPLETIONS, body({"model": "m", "prompt": [1, -2]}), "token ids"),
        (COMPLETIONS, body({"model": "m", "prompt": [2**32]}), "token ids"),
        (COMPLETIONS, body({"model": "m", "prompt": [1, True]}), "'prompt'"),
        (COMPLETIONS, body({"model": "m", "prompt": "x", "stream": "yes"}), "'stream'"),
        (COMPLETIONS, body({"model": "m", "prompt": "x", "max_tokens": 0}), "at least 1"),
        (COMPLETIONS, body({"model": "m", "prompt": "x", "max_tokens": "5"}), "integer"),
        (COMPLETIONS, body({"model": "m", "prompt": "x", "max_tokens": True}), "integer"),
        (COMPLETIONS, body({"model": "m", "prompt": "x", "stream_options": 1}), "stream_options"),
        (CHAT_COMPLETIONS, body({"model": "m", "messages": []}), "'messages'"),
        (CHAT_COMPLETIONS, body({"model": "m", "messages": ["hi"]}), "messages[0]"),
        (CHAT_COMPLETIONS, body({"model": "m", "messages": [{"role": "user", "content": 5}]}), "content"),
    ],
)
def test_malformed_requests_are_400(path, raw, fragment):
    with pytest.raises(RequestError) as info:
        parse_request(path, raw)
    assert info.value.status == 400
    assert fragment in info.value.message
    error = json.loads(info.value.body())
    assert error["object"] == "error" and error["code"] == 400 and error["type"] == "BadRequestError"


def test_error_body_shape_for_other_statuses():
    for status, kind in [(404, "NotFoundError"), (413, "RequestTooLargeError"), (503, "ServiceUnavailableError")]:
        err = json.loads(error_body(status, "why"))
        assert err == {"object": "error", "message": "why", "type": kind, "param": None, "code": status}
