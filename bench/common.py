"""Shared pieces of the benchmarks: model shapes, random models, tokenizer, reward, report.

The models are Qwen2.5-shaped with random weights (seed 0), saved once in bfloat16 so that
reasonctl and each baseline start from identical weights. The tokenizer is a word-level
one over the model's whole vocabulary (``w0 w1 ...`` plus Qwen's chat tokens), so any
sampled id decodes to text and a text reward has something to score.
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

VOCAB = 151936
SHAPES: dict[str, dict[str, int]] = {
    "0.5b": {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "intermediate_size": 4864},
    "1.5b": {"hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2, "intermediate_size": 8960},
    "7b": {"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
           "num_key_value_heads": 4, "intermediate_size": 18944},
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 128},
    "tiny-h64": {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                 "num_key_value_heads": 1, "intermediate_size": 256},
}
"""Qwen2.5 model shapes by name (``tiny`` is for CPU smoke runs of the scripts;
``tiny-h64`` has the head size 64 that vLLM's CPU attention supports)."""
PEAK_FLOPS = 790e12
"""Measured dense bf16 matmul rate of the benchmark GPU (H200), the MFU denominator."""
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_WORDS = ["system", "user", "assistant"]
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + ' ' + message['content'] + '<|im_end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant ' -}}{%- endif -%}"
)


def qwen25_config(size: str) -> Any:
    """A ``Qwen2Config`` of the named shape (rope theta 1e6, bf16; embeddings tied below
    7B, as in Qwen2.5)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_word_embeddings=size != "7b", use_cache=False, dtype="bfloat16",
        bos_token_id=word_count(), eos_token_id=word_count() + 2, pad_token_id=word_count(),
        **SHAPES[size],
    )


def word_count() -> int:
    """How many ``w<i>`` words the tokenizer has (ids below Qwen2.5's first special id)."""
    return 151643


def build_tokenizer(special_tokens: Sequence[str] = tuple(SPECIAL_TOKENS),
                    chat_template: str = CHAT_TEMPLATE) -> Any:
    """A word-level fast tokenizer: ``w<i>`` is id ``i``; then ``special_tokens`` (Qwen's
    chat tokens first, the end-of-text token first of all) and the chat role words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special_tokens = list(special_tokens)
    vocab = {f"w{i}": i for i in range(word_count())}
    for token in (*special_tokens, *CHAT_WORDS, "<unk>"):
        vocab[token] = len(vocab)
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.decoder = decoders.WordPiece()  # joins words with spaces
    raw.add_special_tokens(special_tokens)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token="<unk>", additional_special_tokens=special_tokens[1:],
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def build_model_dir(root: Path, size: str) -> Path:
    """A saved random model of ``size`` (built once, then reused).

    The word tokenizer is saved in its ``tokenizer/`` subdirectory (:func:`tokenizer_dir`):
    next to a Qwen2 ``config.json`` transformers would load its own Qwen2 tokenizer class.
    """
    from transformers import AutoModelForCausalLM

    path = root / f"qwen25-{size}-random"
    if (path / "config.json").is_file():
        return path
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(qwen25_config(size), dtype=torch.bfloat16)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    build_tokenizer().save_pretrained(tmp / "tokenizer")
    del model
    free_memory()
    tmp.rename(path)
    return path


def tokenizer_dir(model_dir: Path) -> Path:
    """Where :func:`build_model_dir` saved the tokenizer."""
    return model_dir / "tokenizer"


def random_rows(count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` rows of ``length`` uniformly random word ids (fixed seed)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, word_count(), (count, length), generator=generator).tolist()


def words(ids: Sequence[int]) -> str:
    """The text of word ids (``w12 w7 ...``)."""
    return " ".join(f"w{i}" for i in ids)


def even_word_reward(completions: Sequence[str], samples: Sequence[Any]) -> list[float]:
    """A cheap rule reward: the fraction of a completion's words with an even id."""
    del samples
    return [_even_fraction(text) for text in completions]


def trl_even_word_reward(completions: Sequence[Any], **_: Any) -> list[float]:
    """:func:`even_word_reward` with TRL's reward-function signature (plain completions, or
    conversational ones: a list of messages whose last content is the completion)."""
    return [_even_fraction(_completion_text(c)) for c in completions]


def _completion_text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    content = completion[-1]["content"]
    if isinstance(content, str):
        return content
    return " ".join(part.get("text", "") for part in content if isinstance(part, dict))


def _even_fraction(text: str) -> float:
    ids = [int(word[1:]) for word in text.split() if word[1:].isdigit()]
    return sum(1 for i in ids if i % 2 == 0) / len(ids) if ids else 0.0


def reasonctl_backend(model_dir: Path, out: Path, *, values: dict[str, Any]) -> tuple[Any, Any]:
    """A set-up ``single`` backend and its run context for ``model_dir``.

    ``values`` are config sections merged over the defaults used by every benchmark.
    """
    from reasonctl.core.config import deep_merge, load_config
    from reasonctl.core.plugins import PluginHost
    from reasonctl.core.protocols import RunContext

    host = PluginHost.load()
    base = {
        "run": {"output_dir": str(out), "seed": 0},
        "model": {"name_or_path": str(model_dir), "tokenizer": str(tokenizer_dir(model_dir)),
                  "dtype": "bfloat16"},
        "train": {"weight_decay": 0.0, "max_grad_norm": 1.0},
        "backend": {"name": "single"},
        "logging": {"loggers": []},
        "checkpoint": {"export_final": False},
    }
    config = load_config(values=deep_merge(base, values), registry=host.registry)
    ctx = RunContext(config=config, registry=host.registry, hooks=host.hooks, output_dir=out)
    ctx.backend = host.registry.get("backend", "single").build(
        config.component_config("backend", "single")
    )
    ctx.backend.setup(ctx)
    return ctx.backend, ctx


def parameter_count(model: Any) -> int:
    """Parameters of ``model`` (tied ones once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def training_mfu(tokens_per_s: float, params: int, config: Any, seq: int) -> float:
    """Model FLOPs utilisation: ``(6N + 12 * layers * hidden * seq)`` per token / peak."""
    from reasonctl.backends.perf import training_flops

    return training_flops(params, config, 1, seq) * tokens_per_s / PEAK_FLOPS


def sync() -> None:
    """Wait for the GPU (no-op on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def now() -> float:
    """A host clock reading after the GPU has finished its queued work."""
    sync()
    return time.perf_counter()


def build_rollout_engine(ctx: Any, options: Any = None) -> Any:
    """The run's ``hf`` rollout engine, built through the registry from ``[rollout.hf]``
    as a run builds it, with the decode path's switches ``options`` (a
    :class:`reasonctl.rollout.DecodeOptions`; None: the fast path)."""
    from reasonctl.rollout.factory import build_hf_engine

    return build_hf_engine(ctx.component_config("rollout", "hf"), ctx=ctx, options=options)


def free_memory() -> None:
    """Drop unreachable objects and cached GPU blocks; reset the peak-memory counter."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_memory_gb() -> float:
    """Peak allocated GPU memory since the last :func:`free_memory` (0 on CPU)."""
    return torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else 0.0


def environment() -> dict[str, Any]:
    """GPU name and library versions, for the record."""
    versions = {}
    for name in ("torch", "transformers", "trl", "accelerate", "datasets"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"gpu": gpu, **versions, "date": time.strftime("%Y-%m-%d")}


def log(message: str) -> None:
    """A progress line on stderr."""
    print(message, file=sys.stderr, flush=True)


def emit(summary: dict[str, Any]) -> None:
    """Print the final JSON line (stdout)."""
    print(json.dumps(summary, default=float), flush=True)


class CliRun:
    """``reasonctl run --algo ALGO --config PATH`` in a process of its own (the path users
    run), with the rows of the run's ``metrics.jsonl``."""

    def __init__(self, algo: str, config: dict[str, Any], path: Path, run_dir: Path) -> None:
        import tomli_w

        path.write_text(tomli_w.dumps(config))
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        self.command = [sys.executable, "-m", "reasonctl", "run", "--algo", algo,
                        "--config", str(path)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(Path.cwd()), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        started = now()
        done = subprocess.run(self.command, capture_output=True, text=True, env=env)
        self.wall_s = round(now() - started, 1)
        self.returncode = done.returncode
        self.stderr = done.stderr
        self.rows: list[dict[str, Any]] = []
        if done.returncode == 0:
            self.rows = [json.loads(line)
                         for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def failure(self) -> dict[str, Any]:
        """The summary of a failed run (its stderr's tail is logged)."""
        log(self.stderr[-4000:])
        return {"ok": False, "rc": self.returncode, "command": " ".join(self.command)}

    def mean(self, key: str, warmup: int) -> float | None:
        """Mean of ``key`` over the steps after ``warmup`` (all steps if none are after)."""
        timed = [r for r in self.rows if r["step"] > warmup] or self.rows
        values = [r[key] for r in timed if key in r]
        return round(statistics.fmean(values), 4) if values else None


def trl_step_clock(*, label: str | None = None, synchronize: bool = False) -> Any:
    """A ``transformers`` trainer callback that times TRL's optimizer steps: ``ends`` (the
    train start, then each step's end), ``logs`` (every logged dict) and ``losses`` (the
    logged ``loss`` values); ``steps()`` are the step times. ``synchronize`` waits for the
    GPU at each step's end; ``label`` logs each step's time under that name."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.logs: list[dict[str, float]] = []
            self.losses: list[float] = []

        def on_train_begin(self, *_: Any, **__: Any) -> None:
            self.ends.append(now())

        def on_step_end(self, *_: Any, **__: Any) -> None:
            if synchronize and torch.cuda.is_available():
                torch.cuda.synchronize()
            self.ends.append(now())
            if label:
                log(f"{label} step {len(self.ends) - 1}: {self.ends[-1] - self.ends[-2]:.3f} s")

        def on_log(self, *_: Any, logs: dict[str, float] | None = None, **__: Any) -> None:
            if logs:
                self.logs.append(dict(logs))
                if "loss" in logs:
                    self.losses.append(float(logs["loss"]))

        def steps(self) -> list[float]:
            return [b - a for a, b in zip(self.ends, self.ends[1:], strict=False)]

    return StepClock()
