"""Options of `dflash generate`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .base import StageConfig
from .options import DTYPE_CHOICES, DTYPES, GENERATE_ENGINES, check, option

__all__ = ["GenerateConfig"]


@dataclass(frozen=True, kw_only=True)
class GenerateConfig(StageConfig):
    """Options of `dflash generate`: regenerate answers with the target."""

    model: str | None = option(unless="server", help="Target model: a Hugging Face folder; required unless --server.")
    prompts: str | None = option(
        unless="self_prompts",
        help="Prompts or whole conversations, in any format --data reads (JSONL, a JSON array such as ShareGPT's, "
             "Parquet, Arrow, a datasets folder; {prompt}, {messages}, {conversations}) or .txt (one prompt a line): "
             "every assistant turn is regenerated in order, system prompts kept; required unless --self-prompts.")
    out: str = option(help="Output JSONL of conversations, or of prompts with --self-prompts (appended; rerun to "
                           "resume).")
    self_prompts: int | None = option(
        None, help="Instead of answering prompts, write N distinct, finished prompts the target writes itself "
                   "(sampled from its chat template's user turn, Magpie-style) to --out, ready for --prompts.")
    exclude: tuple[str, ...] = option(
        (), metavar="FILE",
        help="Prompt files (repeatable; as --prompts reads them) whose prompts --self-prompts must not repeat.")
    max_new_tokens: int = option(256, help="Most tokens per answer.")
    temperature: float = option(0.0, help="Sampling temperature; 0 = greedy.")
    batch_size: int = option(16, help="Prompts answered together (slots of the fast engine, kept full).")
    device: str = option("cpu", choices=("cpu", "cuda"), help="Where the target runs.")
    engine: str = option(
        "auto", choices=GENERATE_ENGINES,
        help="transformers decoding: fast (static KV cache, continuous batching, CUDA graphs on cuda), plain "
             "(transformers' generate); auto is fast where the architecture allows. Recorded beside --out.")
    dtype: str = option("auto", choices=DTYPE_CHOICES,
                        help="Dtype the target runs in: auto is float32 on cpu, the folder's own on cuda. Recorded "
                             "beside --out.")
    seed: int = option(0, help="Seed of sampling (temperature > 0, and --self-prompts).")
    chat_template_kwargs: dict[str, Any] | None = option(
        None, parse="parse_json_object", metavar="JSON",
        help='Extra variables of the chat template as a JSON object, e.g. \'{"enable_thinking": false}\' for Qwen3: '
             'render what the serving engine renders. Recorded; a rerun into the same output must keep them.')
    server: tuple[str, ...] = option(
        (), metavar="URL",
        help="Instead of running --model here: an OpenAI-compatible server (vllm serve, SGLang, transformers serve) "
             "answers through /v1/chat/completions, e.g. http://host:8000 (repeatable: requests are spread over "
             "every server).")
    served_model: str | None = option(
        None, help="With --server: the model name the servers serve [default: the one model they list]. Recorded; "
                   "a rerun into the same output must keep it.")
    concurrency: int = option(64, help="With --server: requests in flight, spread over the servers.")
    top_p: float | None = option(None, help="With --server: nucleus sampling [default: the server's].")
    top_k: int | None = option(None, help="With --server: top-k sampling [default: the server's; transformers serve "
                                          "refuses it].")
    sampling_mix: tuple[dict[str, Any], ...] | None = option(
        None, parse="parse_sampling_mix", metavar="JSON",
        help='With --server: per-prompt sampling as a JSON list of weighted entries, each prompt drawing one by its '
             'row and --seed, e.g. \'[{"weight": 0.7, "temperature": 0}, {"weight": 0.3, "temperature": 0.6, '
             '"chat_template_kwargs": {"enable_thinking": true}}]\'; an entry overrides --temperature, --top-p, '
             '--top-k and adds to --chat-template-kwargs. Each row records what it got.')
    server_timeout: float = option(
        600.0, help="With --server: seconds to wait for a server to come up (or back), and for one answer; a request "
                    "is retried with backoff within it on timeouts, connection errors and 5xx answers.")

    def __post_init__(self) -> None:
        check(self.self_prompts is not None or self.prompts is not None,
               "--prompts is required (a prompts file to answer), unless --self-prompts N writes prompts instead")
        check(self.self_prompts is None or self.prompts is None,
               f"--prompts {self.prompts} and --self-prompts {self.self_prompts} exclude each other: the first "
               "answers prompts, the second writes them; run one, then the other")
        check(self.self_prompts is None or self.self_prompts >= 1,
               f"--self-prompts must be >= 1, got {self.self_prompts}")
        check(not self.exclude or self.self_prompts is not None, "--exclude applies to --self-prompts only")
        check(self.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        check(self.temperature >= 0, f"--temperature must be >= 0, got {self.temperature}")
        check(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        check(self.device in ("cpu", "cuda"), f"--device {self.device!r}: use cpu or cuda")
        check(self.model is not None or bool(self.server),
               "--model is required (a target folder to run here), unless --server URL answers instead")
        check(self.model is None or not self.server,
               f"--model {self.model} and --server exclude each other: the first runs the target here, the second "
               "asks a server that runs it (name it with --served-model); pass one")
        check(not self.server or self.self_prompts is None,
               "--self-prompts runs the target here; pass --model instead of --server")
        in_process = {"--top-p": self.top_p, "--top-k": self.top_k, "--sampling-mix": self.sampling_mix,
                      "--served-model": self.served_model}
        given = [flag for flag, v in in_process.items() if v is not None]
        check(bool(self.server) or not given,
               f"{', '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to --server only (the engine here samples with --temperature alone); "
               "drop them or pass --server URL")
        bad = [u for u in self.server if not u.startswith(("http://", "https://"))]
        check(not bad, f"--server {bad[0] if bad else ''}: expected a URL like http://host:8000")
        check(self.concurrency >= 1, f"--concurrency must be >= 1, got {self.concurrency}")
        check(self.server_timeout > 0, f"--server-timeout must be > 0, got {self.server_timeout}")
        check(self.top_p is None or 0 < self.top_p <= 1, f"--top-p must be in (0, 1], got {self.top_p}")
        check(self.top_k is None or self.top_k >= 1, f"--top-k must be >= 1, got {self.top_k}")
        check(self.engine in GENERATE_ENGINES, f"--engine {self.engine!r}: use {', '.join(GENERATE_ENGINES)}")
        check(self.dtype in DTYPE_CHOICES, f"--dtype {self.dtype!r}: use auto, {', '.join(DTYPES)}")
