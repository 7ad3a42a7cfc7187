"""Real vLLM on CPU for the llumlet's tests and benchmarks: a tiny local model and a launcher.

`build_tiny_llama(dir)` writes a 2-layer Llama config (head_dim 64, which vLLM's CPU attention
supports) and a byte-level BPE tokenizer trained on the spot, with a chat template; vLLM runs
it with `--load-format dummy`, so no weights and no download. `start_vllm(...)` runs the OpenAI
server from the vLLM virtualenv (scripts/install-vllm.sh) as a `procs.Child` on a free loopback
port and waits until /health answers.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from pilotfish.procs import Child, StartError, free_port, wait_until
from pilotfish.services import LOOPBACK, http_call

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON_ENV = "PILOTFISH_VLLM_PYTHON"
# more vLLM arguments for every engine started here, after the defaults (a later flag wins in vLLM's
# parser): a GPU run shares one device among the engines, e.g. "--gpu-memory-utilization 0.2"
VLLM_ARGS_ENV = "PILOTFISH_VLLM_ARGS"
SCHEDULER_CLS = "pilotfish.vllm_plugin.LlumletScheduler"
MODEL_NAME = "tiny-llama"

_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "pilotfish schedules requests for fleets of engines",
    "a llumlet exports load the instant it changes",
    "prefill decode waiting running tokens blocks cache prefix",
] * 50


def vllm_python() -> Path | None:
    """The Python that has vLLM: $PILOTFISH_VLLM_PYTHON, else ./.venv-vllm, else None."""
    explicit = os.environ.get(VLLM_PYTHON_ENV)
    candidate = Path(explicit) if explicit else REPO / ".venv-vllm" / "bin" / "python"
    return candidate if candidate.exists() else None


def vllm_args_from_env() -> list[str]:
    """$PILOTFISH_VLLM_ARGS split as a shell would (quotes kept together); empty when unset."""
    return shlex.split(os.environ.get(VLLM_ARGS_ENV, ""))


def build_tiny_llama(out: Path, vocab_size: int = 512) -> Path:
    """A dummy-weight Llama that vLLM on CPU starts in about two minutes; idempotent."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out.mkdir(parents=True, exist_ok=True)
    if (out / "tokenizer.json").exists() and (out / "config.json").exists():
        return out
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "model_max_length": 2048, "chat_template": _CHAT_TEMPLATE,
    }))  # fmt: skip
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64,
        "vocab_size": tokenizer.get_vocab_size(), "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }))  # fmt: skip
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    return out


def vllm_env(llumlet_env: dict[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PILOTFISH_")}
    env.update({
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "NO_PROXY": "*", "no_proxy": "*",
    })  # fmt: skip
    env.update(llumlet_env or {})
    return env


def engine_cpus(count: int) -> list[str]:
    """A CPU id for each of `count` engines on this machine, distinct while there are enough.

    vLLM on CPU binds every engine's worker to the same cores by default, and a worker that has
    just been called busy-waits (sched_yield) for a second for the next call: two engines on one
    core then starve each other to about a step a second.
    """
    cpus = sorted(os.sched_getaffinity(0))
    return [str(cpus[i % len(cpus)]) for i in range(count)]


def start_vllm(
    model_dir: Path,
    work_dir: Path,
    *,
    llumlet_env: dict[str, str] | None = None,
    with_plugin: bool = True,
    extra_args: list[str] | None = None,
    port: int | None = None,
    log_stats: bool = False,
    timeout: float = 600.0,
    name: str = "vllm",
    scheduler_cls: str = SCHEDULER_CLS,
    worker_cpus: str | None = None,
) -> tuple[Child, str]:
    """vLLM's OpenAI server on 127.0.0.1; returns (child, base URL) once /health answers 200.

    `with_plugin` selects the llumlet scheduler class; without it vLLM runs its default.
    `worker_cpus` pins the model worker to those CPU ids ("1", "2-3"); see `engine_cpus`.
    $PILOTFISH_VLLM_ARGS adds arguments last (see `vllm_args_from_env`).
    """
    python = vllm_python()
    if python is None or not python.exists():
        raise StartError(f"vLLM not installed: run scripts/install-vllm.sh (or set {VLLM_PYTHON_ENV})")
    work_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    argv = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", MODEL_NAME,
        "--host", LOOPBACK, "--port", str(port),
        "--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", "1024",
        "--max-num-seqs", "16", "--max-num-batched-tokens", "1024",
        "--enforce-eager",
    ]  # fmt: skip
    if not log_stats:
        argv.append("--disable-log-stats")
    if with_plugin:
        argv += ["--scheduler-cls", scheduler_cls]
    argv += extra_args or []
    argv += vllm_args_from_env()
    log_path = work_dir / f"{name}.log"
    env = vllm_env(llumlet_env)
    if worker_cpus is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = worker_cpus
    child = Child(name, argv, env=env, log_path=log_path, cwd=work_dir)
    url = f"http://{LOOPBACK}:{port}"

    def healthy() -> bool:
        try:
            return http_call(f"{url}/health", timeout=2)[0] == 200
        except OSError:
            return False

    try:
        wait_until(healthy, timeout, f"vLLM at {url} (log: {log_path})", interval=1.0, alive=child.exited)
    except BaseException:
        child.stop()
        raise
    return child, url
