"""Parse and validate the OpenAI requests the gateway routes, and shape its errors.

Only what scheduling needs is extracted (model, prompt text, stream flag, token limit);
the body itself is forwarded to the engine unchanged. Every rejection carries the HTTP
status and an OpenAI-shaped JSON body, so the gateway answers it without touching an engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
ROUTED_PATHS = (COMPLETIONS, CHAT_COMPLETIONS)
# Sent to any engine without scheduling (ExtProcConfig.unscheduled_paths): read-only, no load. Every other path
# is refused, so a client cannot reach an engine's API past the scheduler and flow control: another generating
# endpoint (/v1/responses, /v1/embeddings), a spelling the engine decodes to a routed one (/v1/%63ompletions),
# or an engine's admin endpoint under /v1/ (vLLM's /v1/load_lora_adapter).
UNSCHEDULED_PATHS = ("/v1/models", "/health")

_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

_json_decoder = msgspec.json.Decoder()
_json_encoder = msgspec.json.Encoder()


class RequestError(Exception):
    """A request the gateway refuses; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str, param: str | None = None, retry_after: int = 0) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after = retry_after  # seconds, sent as Retry-After (0: none)

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    """The JSON error vLLM's OpenAI server returns, so clients parse ours the same way."""
    return _json_encoder.encode(
        {
            "object": "error",
            "message": message,
            "type": _ERROR_TYPES.get(status, "Error"),
            "param": param,
            "code": status,
        }
    )


@dataclass(slots=True)
class ParsedRequest:
    path: str
    model: str
    prompt_text: str
    stream: bool
    max_tokens: int | None
    include_usage: bool
    body: dict[str, Any]
    # a completion prompt given as token ids: counted and hashed as they are, never re-tokenized
    prompt_token_ids: list[int] | None = None

    def body_requesting_usage(self) -> bytes:
        """The body re-encoded with `stream_options.include_usage`, for an exact generated-token count."""
        options = self.body.get("stream_options") or {}
        # decoding bounded the nesting, so encoding it back cannot recurse deeper
        return _json_encoder.encode({**self.body, "stream_options": {**options, "include_usage": True}})


def route_path(path: str) -> str:
    """The path without its query string."""
    return path.split("?", 1)[0]


def parse_request(path: str, body: bytes) -> ParsedRequest:
    """Validate an OpenAI completion or chat body; raise RequestError on anything malformed."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(400, f"request body is not valid UTF-8 (byte {exc.start})") from None
    if not text.strip():
        raise RequestError(400, "request body is empty; expected a JSON object")
    try:
        data = _json_decoder.decode(text)
    except msgspec.DecodeError as exc:
        raise RequestError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # msgspec's decoder recurses per level of nesting
        raise RequestError(400, "request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise RequestError(400, "request body must be a JSON object")

    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(400, "'model' is required and must be a non-empty string", "model")

    stream = data.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be a boolean", "stream")

    max_tokens = _max_tokens(data, chat=path == CHAT_COMPLETIONS)
    prompt_ids = None if path == CHAT_COMPLETIONS else _prompt_token_ids(data)
    prompt_text = "" if prompt_ids is not None else _chat_text(data) if path == CHAT_COMPLETIONS else _prompt_text(data)

    include_usage = False
    options = data.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise RequestError(400, "'stream_options' must be an object", "stream_options")
        include_usage = options.get("include_usage") is True
    return ParsedRequest(path, model, prompt_text, stream, max_tokens, include_usage, data, prompt_ids)


def _max_tokens(data: dict[str, Any], chat: bool) -> int | None:
    keys = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    for key in keys:
        value = data.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise RequestError(400, f"'{key}' must be an integer", key)
        if value < 1:
            raise RequestError(400, f"'{key}' must be at least 1, got {value}", key)
        if value > MAX_UINT32:  # the scheduler's API (and any engine) holds it in 32 bits
            raise RequestError(400, f"'{key}' must be at most {MAX_UINT32}, got {value}", key)
        return value
    return None


MAX_UINT32 = 2**32 - 1
MAX_TOKEN_ID = MAX_UINT32  # vocabularies are far smaller; beyond this an id cannot be one


def _prompt_token_ids(data: dict[str, Any]) -> list[int] | None:
    """The prompt as token ids, when the client sent them (`"prompt": [1, 2, 3]`); else None."""
    prompt = data.get("prompt")
    if not isinstance(prompt, list) or not prompt or not all(type(p) is int for p in prompt):
        return None
    if not all(0 <= p <= MAX_TOKEN_ID for p in prompt):
        raise RequestError(400, "'prompt' token ids must be integers from 0 to 2^32-1", "prompt")
    return prompt


def _prompt_text(data: dict[str, Any]) -> str:
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return "".join(prompt)
    raise RequestError(400, "'prompt' is required: a string, a list of strings or a list of token ids", "prompt")


def _chat_text(data: dict[str, Any]) -> str:
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' is required and must be a non-empty list", "messages")
    parts: list[str] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(400, f"messages[{i}] must be an object with a string 'role'", "messages")
        content = message.get("content")
        if content is None:
            continue
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            for piece in content:
                if isinstance(piece, dict) and isinstance(piece.get("text"), str):
                    parts.append(piece["text"])
        else:
            raise RequestError(400, f"messages[{i}].content must be a string or a list of parts", "messages")
    return "\n".join(parts)
