"""The OpenAI API as vLLM speaks it: request validation, error bodies and response shapes.

Kept apart from the HTTP plumbing so its rules can be tested as plain functions and so the
shapes have one home.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec

from pilotfish.simulator.tokens import Tokenizer, render_chat


class ApiError(Exception):
    """An error answered as vLLM's JSON body with the matching status."""

    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"object": "error", "message": self.message, "type": self.type, "param": self.param,
                "code": self.status}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "BadRequestError", param)


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    chat: bool
    model: str
    prompt_token_ids: list[int]
    max_tokens: int | None  # None: the client gave none
    stream: bool
    include_usage: bool
    continuous_usage_stats: bool
    ignore_eos: bool


def decode_body(body: bytes) -> dict[str, Any]:
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise bad_request(f"Invalid JSON in request body: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request("Request body must be a JSON object")
    return data


def parse_request(data: dict[str, Any], *, chat: bool, served_model: str, tokenizer: Tokenizer) -> ParsedRequest:
    model = data.get("model", served_model)
    if model is None:
        model = served_model
    if not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    if model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    prompt_token_ids = _chat_prompt(data, tokenizer) if chat else _completion_prompt(data, tokenizer)

    max_tokens = data.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = data.get("max_tokens")
    if max_tokens is not None:
        if not _is_int(max_tokens):
            raise bad_request("max_tokens must be an integer", "max_tokens")
        if max_tokens < 1:
            raise bad_request(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    n = data.get("n", 1)
    if n is not None and (not _is_int(n) or n != 1):
        raise bad_request("n must be 1: the simulator generates one choice per request", "n")
    stream = _optional_bool(data, "stream")
    ignore_eos = _optional_bool(data, "ignore_eos")
    options = data.get("stream_options")
    include_usage = continuous = False
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("stream_options must be an object", "stream_options")
        if not stream:
            raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
        include_usage = _optional_bool(options, "include_usage")
        continuous = _optional_bool(options, "continuous_usage_stats")
    return ParsedRequest(chat, model, prompt_token_ids, max_tokens, stream, include_usage, continuous, ignore_eos)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_bool(data: dict[str, Any], key: str) -> bool:
    value = data.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"{key} must be a boolean", key)
    return value


def _completion_prompt(data: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    prompt = data.get("prompt")
    if prompt is None:
        raise bad_request("'prompt' is required", "prompt")
    # vLLM accepts a batch of prompts; the simulator takes one (one choice per request).
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(_is_int(t) and t >= 0 for t in prompt):
        ids = list(prompt)
    else:
        raise bad_request("'prompt' must be a string, a list of token ids, or a list holding one of those",
                          "prompt")
    if not ids:
        raise bad_request("The prompt cannot be empty", "prompt")
    return ids


def _chat_prompt(data: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    messages = data.get("messages")
    if messages is None:
        raise bad_request("'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request("each message must be an object with a string 'role'", "messages")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise bad_request("message 'content' must be a string or a list of parts", "messages")
    return tokenizer.encode(render_chat(messages))


def context_length_error(max_model_len: int, prompt_tokens: int, max_tokens: int | None) -> ApiError:
    if max_tokens is None:
        message = (f"This model's maximum context length is {max_model_len} tokens. However, your request has "
                   f"{prompt_tokens} input tokens. Please reduce the length of the input messages.")
    else:
        message = (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                   f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in "
                   f"the completion). Please reduce the length of the messages or completion.")
    return bad_request(message)


class ResponseShape:
    """Builds the JSON of one request's chunks and final response, vLLM's field for field."""

    def __init__(self, request_id: str, model: str, chat: bool, prompt_tokens: int) -> None:
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.model = model
        self.chat = chat
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, text: str | None, finish_reason: str | None, *, role: bool = False,
              usage: dict[str, int] | None = None) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            out = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason,
                      "stop_reason": None}
            out = self._head("text_completion")
        out["choices"] = [choice]
        if usage is not None:
            out["usage"] = usage
        return out

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        out = self._head("chat.completion.chunk" if self.chat else "text_completion")
        out["choices"] = []
        out["usage"] = self.usage(completion_tokens)
        return out

    def full(self, text: str, finish_reason: str | None, completion_tokens: int) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                      "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
            out = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                      "stop_reason": None, "prompt_logprobs": None}
            out = self._head("text_completion")
        out["choices"] = [choice]
        out["usage"] = self.usage(completion_tokens)
        return out


def models_response(model: str, max_model_len: int) -> dict[str, Any]:
    return {"object": "list", "data": [{
        "id": model, "object": "model", "created": int(time.time()), "owned_by": "pilotfish",
        "root": model, "parent": None, "max_model_len": max_model_len,
    }]}


_ENCODER = msgspec.json.Encoder()


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _ENCODER.encode(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
