"""dflash.config: frozen, keyword-only configuration of each stage, validated on construction and saved as JSON beside
its output. One module a command (extract.py, train.py, generate.py, evaluate.py, demo.py, run.py) over base.py
(StageConfig: the JSON round trip) and options.py (option(), the shared choices and options, the parsers)."""
from __future__ import annotations

from .base import StageConfig
from .demo import DEMO_BUDGETS, DemoConfig
from .evaluate import EvalConfig
from .extract import ExtractConfig
from .generate import GenerateConfig
from .options import (CODECS, OFFLOADS, DPACE_ALPHA, DRAFTERS, DTYPE_CHOICES, DTYPES, GENERATE_ENGINES, LEGACY_DEFAULTS,
                      POSITION_WEIGHTS, option, parse_budgets, parse_gpus, parse_json_object, parse_layers,
                      parse_sampling_mix, parse_shard_ids, parse_val_fraction, resolve_devices)
from .run import RUN_SHARED, RunConfig, run_stage_options
from .train import TrainConfig

__all__ = ["option", "parse_layers", "parse_val_fraction", "parse_shard_ids", "parse_json_object", "parse_sampling_mix",
           "parse_budgets", "StageConfig", "ExtractConfig", "TrainConfig", "GenerateConfig", "EvalConfig", "DemoConfig",
           "RunConfig", "RUN_SHARED", "run_stage_options", "parse_gpus", "resolve_devices", "CODECS", "DRAFTERS",
           "DTYPES", "DTYPE_CHOICES", "GENERATE_ENGINES", "POSITION_WEIGHTS", "DPACE_ALPHA", "LEGACY_DEFAULTS",
           "DEMO_BUDGETS", "OFFLOADS"]
