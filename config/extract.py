"""Options of `dflash extract`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .base import StageConfig
from .options import (CODECS, COMPILES, DTYPE_CHOICES, OFFLOADS, check, option, parse_gpus,
                      parse_shard_weights)

__all__ = ["ExtractConfig"]


@dataclass(frozen=True, kw_only=True)
class ExtractConfig(StageConfig):
    """Options of `dflash extract`: target, data, store, devices, capture and sharding."""

    model: str = option(help="Target model: a Hugging Face folder (config.json, weights, tokenizer).")
    data: tuple[str, ...] = option(
        help="Conversations (repeatable): .jsonl or .json (one array) rows of {messages: [{role, content}]}, "
             "ShareGPT {conversations: [{from, value}]} or Alpaca {instruction, output}; .parquet/.arrow with such "
             "columns; or a `datasets` save_to_disk folder.", metavar="FILE")
    out: str = option(help="Store path (a folder or an fsspec URL); rerun the same command to resume.")
    gpus: str = option("0,1,2,3,4", help="GPU indices (0,1,2 or 0-4; one worker process each), or cpu.")
    layers: tuple[int, ...] | None = option(
        None, cli_default="auto", parse="parse_layers",
        help="Target decoder layers to capture: auto (5 evenly spaced from 1 to L-3, as DFlash does) or ids like "
             "1,9,17,25,33.")
    max_length: int = option(4096, help="Tokens per conversation; longer ones are cut (and counted).")
    min_loss_tokens: int = option(32, help="Drop conversations with fewer assistant (loss) tokens than this.")
    shard_size: int | None = option(None, help="Source rows per shard [default: sized to ~2 GB of features].")
    batch_tokens: int | None = option(
        None, help="Tokens per target forward batch, padding included (>= --max-length) [default: 32768; 65536 when "
                   "the target's weights are sharded, so that streaming them is small against the forward; offloaded "
                   "on a GPU, 65536 doubled while a layer's compute would not hide its copy over the host link "
                   "measured at start, as far as GPU and host memory allow; the log and --dry-run say why].")
    codec: str = option("auto", choices=("auto", *CODECS),
                        help="Feature encoding: auto is uq6 for a new store and a store's own codec when it is resumed. "
                             "uq6 (lossy, ~0.35x raw bf16: each token's layer row in integer steps "
                             "of 1/6 of its median magnitude, zstd-coded; the GPU demo's drafter measured tau 1.03x "
                             "the lossless store's), uq8 / uq4 (the same in steps of 1/8 / 1/4, ~0.37x / ~0.31x), "
                             "blosc (lossless, ~0.69x), none (raw), fp8 (lossy, ~0.42x, measured tau 0.988x), bf16m3 "
                             "/ bf16m2 / bf16m1 (lossy, ~0.45x / ~0.39x / ~0.35x: bf16 rounded to 3 / 2 / 1 of its 7 "
                             "mantissa bits, no scales). On a GPU the scaled codecs (uq, fp8) are computed on it.")
    compile_layers: str = option(
        "auto", choices=COMPILES,
        help="Run the target's decoder layers under torch.compile where the self-check finds them exact: on, off, or "
             "auto (on a GPU for a run of 10M tokens or more left, where the compilation, tens of seconds a worker, "
             "is small against the forward it speeds up: 1.5-1.6x on a Qwen3-30B-A3B shape, 1.58x on a gpt-oss-20b "
             "shape, bench/RESULTS.md; not where the target has Gated DeltaNet layers, not measured faster yet). Not "
             "for --shard-weights or --offload targets. "
             "The log and the store header say whether it ran.")
    chat_template: str | None = option(None, help="Jinja chat template file to use instead of the tokenizer's.")
    chat_template_kwargs: dict[str, Any] | None = option(
        None, parse="parse_json_object", metavar="JSON",
        help='Extra variables of the chat template as a JSON object, e.g. \'{"enable_thinking": false}\' for Qwen3: '
             'render what the serving engine renders. Recorded; a rerun into the same output must keep them.')
    mask_token_id: int | None = option(
        None, help="Mask token of the drafter's blocks. Default: the first embedding row the tokenizer does not use "
                   "(when vocab_size > len(tokenizer)); a target with a full vocabulary needs an unused special "
                   "token's id here. Recorded in the store.")
    strict: bool = option(False, help="Stop at the first bad row instead of counting it.")
    dtype: str = option("auto", choices=DTYPE_CHOICES,
                        help="Dtype the target runs in: auto is bfloat16 on CUDA and on CPUs with native bf16, "
                             "float32 on other CPUs (a store being resumed keeps its own). Recorded in the store.")
    writer_threads: int | None = option(
        None, help="Threads per worker that compress and write chunks [default: this machine's CPUs shared among "
                   "its workers, 2-16].")
    shard_weights: str = option(
        "auto", metavar="auto|K",
        help="GPUs that share one copy of the target's weights (FSDP2, each holding 1/K, every GPU still forwarding "
             "its own rows): 1 keeps a whole copy on every GPU (today's path); auto keeps it when the captured "
             "layers fit one GPU beside a batch, else picks the fewest GPUs of a node (then of the run) that hold "
             "them, else --offload cpu. K must divide the number of ranks. The log and --dry-run say what was "
             "chosen and why.")
    offload: str = option(
        "none", choices=OFFLOADS,
        help="cpu: the weights (or each rank's shard of them) live in pinned host memory and are copied to the GPU "
             "layer by layer, the next layer while the current one runs (one GPU can run a target larger than "
             "itself; a node's host memory holds one copy in all); none: they stay on the GPUs.")
    collective_timeout: int = option(
        600, help="Seconds a rank of a sharded target waits in a collective before it gives up (a peer killed or "
                  "hung): every rank then ends with one line, and rerunning the same command resumes.")
    dry_run: bool = option(False, help="Print the plan (samples, tokens, drops, projected store size, free space, "
                                       "times) and exit without writing.")
    force: bool = option(False, help="Start even when the projected store is larger than the free space.")
    profile: str | None = option(
        None, metavar="FILE",
        help="Write each worker's timeline as JSON to FILE: seconds of start-up (imports, device, model load, data, "
             "plan) and per shard (tokenise, pack, forward, copy, waits, compress, write+fsync, commit); on CUDA also "
             "the device's time in each forward and idle between them (events, no synchronize: it runs as fast); "
             "and one row a forward (shard, rows, length, tokens, its seconds) to find a run's slow batches.")

    def __post_init__(self) -> None:
        check(bool(self.data), "--data needs at least one file or folder")
        parse_gpus(self.gpus)
        check(self.max_length >= 2, f"--max-length must be >= 2, got {self.max_length}")
        check(self.min_loss_tokens >= 0, f"--min-loss-tokens must be >= 0, got {self.min_loss_tokens}")
        check(self.shard_size is None or self.shard_size >= 1, f"--shard-size must be >= 1, got {self.shard_size}")
        check(
            self.batch_tokens is None or self.batch_tokens >= self.max_length,
            f"--batch-tokens ({self.batch_tokens}) must be >= --max-length ({self.max_length}) so every sample fits",
        )
        check(self.codec == "auto" or self.codec in CODECS,
              f"--codec {self.codec!r} is not auto or one of {', '.join(CODECS)}")
        check(self.dtype in DTYPE_CHOICES, f"--dtype {self.dtype!r} is not one of {', '.join(DTYPE_CHOICES)}")
        check(self.mask_token_id is None or self.mask_token_id >= 0, "--mask-token-id must be >= 0")
        check(self.writer_threads is None or self.writer_threads >= 1,
               f"--writer-threads must be >= 1, got {self.writer_threads}")
        parse_shard_weights(self.shard_weights)
        check(self.compile_layers in COMPILES,
              f"--compile-layers {self.compile_layers!r} is not one of {', '.join(COMPILES)}")
        check(self.offload in OFFLOADS, f"--offload {self.offload!r} is not one of {', '.join(OFFLOADS)}")
        check(self.collective_timeout >= 1, f"--collective-timeout must be >= 1, got {self.collective_timeout}")
        if self.layers is not None:
            check(len(self.layers) >= 1, "--layers is empty; pass auto or e.g. 1,9,17,25,33")
