"""The demo's final table: every number the run measured, as the record written to OUT/summary.json and as the
aligned text lines printed at the end."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .stages import Demo

__all__ = ["summary_table", "format_table"]


def summary_table(d: "Demo", stages: dict[str, dict[str, Any]], this_run_seconds: float, *, curve: str | None,
                  summary: str) -> dict[str, Any]:
    """Return the final table of a run from its stages' records (curve: the training curve's path, if there is one;
    summary: the path the table is written to)."""
    ev_r, dec_r, he_r = stages["eval"], stages["decode"], stages["humaneval"]
    cfg, budget = d.cfg, d.budget
    return {
        "target": "SmolLM2-135M-Instruct (embedded)",
        "device": cfg.device,
        "budget": cfg.budget,
        "position_weights": cfg.position_weights,
        "prompts_answered": stages["generate"]["prompts"],
        "self_written_prompts": stages["prompts"]["self_written"],
        "answers_dtype": ", ".join(dec_r.get("data_numerics") or []) or None,
        "tokens_extracted": stages["extract"]["tokens"],
        "store_bytes": stages["extract"]["bytes"],
        "training_seconds": stages["train"]["seconds"],
        "training_steps": stages["train"]["steps"],
        "drafter": f"{cfg.drafter}, {budget.draft_layers} layers, block {budget.block_size}",
        "tokens_trained_on": ev_r.get("tokens_trained_on"),
        "held_out_prompts": (ev_r["held_out_samples"] // d.rows_per_prompt) if "held_out_samples" in ev_r else None,
        "tau_hat": round(ev_r["tau_hat"], 3),
        "slot_accuracy": [round(a, 3) for a in ev_r.get("slot_accuracy", [])],
        **_decoding(ev_r, dec_r),
        "humaneval": None if "skipped" in he_r else {
            "prompts": he_r["prompts"], "tau": round(he_r["tau"], 3), "identical_prompts": he_r["identical_prompts"],
            "tau_hat_same_anchors": _rounded(he_r.get("tau_hat_same_anchors")),
            "speedup_wall_clock": round(he_r["speedup_wall_clock"], 3)},
        "humaneval_skipped": he_r.get("skipped"),
        "stage_seconds": {name: record["seconds"] for name, record in stages.items()},
        "this_run_seconds": round(this_run_seconds, 1),
        "training_curve": curve,
        "drafter_folder": str(d.drafter_dir),
        "summary": summary,
    }


def _decoding(ev_r: dict[str, Any], dec_r: dict[str, Any]) -> dict[str, Any]:
    """Return the table's columns of the held-out prompts' decoding."""
    return {
        "tau": round(dec_r["tau"], 3),
        # DDTree: teacher-forced tree tau on the held-out shards per budget, and greedy tree decoding measured.
        "tree_tau_hat": {str(n): round(t, 3) for n, t in zip(ev_r.get("tree_budgets", ()), ev_r.get("tree_tau", ()))},
        "trees": {n: {k: _rounded(v) if isinstance(v, float) else v for k, v in t.items()}
                  for n, t in (dec_r.get("trees") or {}).items()},
        # Teacher-forced over the decoded answers: at the anchors decoding used, and at every anchor (eval's way).
        "tau_hat_decoded_same_anchors": _rounded(dec_r.get("tau_hat_same_anchors")),
        "tau_hat_decoded_every_anchor": _rounded(dec_r.get("tau_hat_every_anchor")),
        "parity_blocks_differ": dec_r.get("blocks_differ"),
        "held_out_prompts_decoded": dec_r["prompts"],
        "tokens_decoded": dec_r.get("tokens"),
        "speedup_target_forwards": round(dec_r["speedup_forwards"], 3),
        "forwards_greedy": dec_r["forwards_greedy"],
        "forwards_speculative": dec_r["forwards_speculative"],
        "speedup_wall_clock": round(dec_r["seconds_greedy"] / dec_r["seconds_speculative"], 3)
        if dec_r["seconds_speculative"] else None,
        "seconds_greedy": round(dec_r["seconds_greedy"], 3),  # the speed-up above is their ratio
        "seconds_speculative": round(dec_r["seconds_speculative"], 3),
        "tokens_per_s_greedy": _rounded(dec_r.get("tokens_per_s_greedy"), 1),
        "tokens_per_s_speculative": _rounded(dec_r.get("tokens_per_s_speculative"), 1),
        "decoding_engine": dec_r.get("engine"),
        "identical_to_greedy": bool(dec_r["identical"]),
        "identical_prompts": dec_r["identical_prompts"],
        "replay": dec_r.get("replay"),  # the `dflash eval --prompts` command that decodes the same prompts alike
    }


def _rounded(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def _wall_clock(t: dict[str, Any]) -> str:
    """Return the wall-clock speed-up said plainly: faster or slower, and why slower where it is."""
    w = t.get("speedup_wall_clock")
    if w is None:
        return "not timed"
    times = f"{w:.2f}x ({t['seconds_greedy']:.1f} s greedy -> {t['seconds_speculative']:.1f} s)"
    if w >= 1:
        return f"{times}, faster"
    why = ("on a CPU the drafter's forwards cost more than the target forwards they save" if t["device"] == "cpu"
           else "the drafter's forwards cost more than the target forwards they save")
    return f"{times}, slower: {why}"


def _humaneval(t: dict[str, Any]) -> str:
    he = t.get("humaneval")
    if not he:
        return f"not run ({t.get('humaneval_skipped') or 'not in this budget'})"
    same = f", tau_hat {he['tau_hat_same_anchors']:.2f} at its anchors" if he.get("tau_hat_same_anchors") else ""
    return (f"{he['tau']:.2f} over {he['prompts']} prompts{same}, {he['speedup_wall_clock']:.2f}x wall clock, "
            f"identical {he['identical_prompts']}/{he['prompts']}")


def format_table(t: dict[str, Any]) -> str:
    """Return the final table as aligned text lines."""
    held = f", {t['held_out_prompts']} prompts held out" if t.get("held_out_prompts") is not None else ""
    trained = f", trained on {t['tokens_trained_on']:,} tokens" if t.get("tokens_trained_on") is not None else ""
    same = t.get("tau_hat_decoded_same_anchors")
    own = f", {t['self_written_prompts']:,} of them written by the target" if t.get("self_written_prompts") else ""
    dtype = f", answers in {t['answers_dtype']}" if t.get("answers_dtype") else ""
    weights = f", {t['position_weights']} position weights" if t.get("position_weights") else ""
    rows = [
        ("target", f"{t['target']} on {t['device']}"),
        ("tokens extracted", f"{t['tokens_extracted']:,} ({t['prompts_answered']} prompts answered{own}{held}"
                             f"{dtype})"),
        ("store size", f"{t['store_bytes'] / 1e6:.1f} MB"),
        ("training time", f"{t['training_seconds']:.0f} s ({t['training_steps']} steps, drafter {t['drafter']}"
                          f"{weights}{trained})"),
        ("tau_hat (held-out, teacher-forced)", f"{t['tau_hat']:.2f}"),
        ("per-slot accuracy (held-out)", " ".join(f"{a:.3f}" for a in t.get("slot_accuracy", [])) or "-"),
        ("tau (measured, held-out prompts)", f"{t['tau']:.2f} over {t['held_out_prompts_decoded']} prompts"
                                             f"{f' ({tokens:,} tokens)' if (tokens := t.get('tokens_decoded')) else ''}"),
    ]
    if t.get("replay"):
        rows.append(("the same decoding again", t["replay"]))
    if t.get("tree_tau_hat"):
        rows.append(("tree tau_hat (held-out, N nodes)", ", ".join(f"N={n} {v:.2f}"
                                                                   for n, v in t["tree_tau_hat"].items())))
    for n, tree in (t.get("trees") or {}).items():
        rows.append((f"tree decoding, N={n}", f"tau {tree['tau']:.2f}, {tree['speedup_forwards']:.2f}x fewer target "
                                              f"forwards, {tree['speedup_wall_clock']:.2f}x greedy wall clock "
                                              f"({tree['speedup_vs_path']:.2f}x the path), identical "
                                              f"{tree['identical_prompts']}/{t['held_out_prompts_decoded']}"))
    if same is not None:
        rows.append(("tau_hat on the decoded answers", f"{same:.2f} at the anchors decoding used, "
                                                       f"{t['tau_hat_decoded_every_anchor']:.2f} at every anchor"))
    rows += [
        ("speed-up in target forwards", f"{t['speedup_target_forwards']:.2f}x "
                                        f"({t['forwards_greedy']} greedy -> {t['forwards_speculative']})"),
        ("speed-up in wall clock", _wall_clock(t)),
        ("tokens/s", f"{t['tokens_per_s_greedy']:.0f} greedy, {t['tokens_per_s_speculative']:.0f} speculative "
                     f"({t.get('decoding_engine') or 'dynamic'} decoding)" if t.get("tokens_per_s_greedy") else "-"),
        ("output identical to greedy", f"{'yes' if t['identical_to_greedy'] else 'no'} "
                                       f"({t['identical_prompts']}/{t['held_out_prompts_decoded']} prompts)"),
        ("tau (measured, HumanEval)", _humaneval(t)),
        ("stage seconds", ", ".join(f"{k} {v:.0f}" for k, v in t["stage_seconds"].items())),
    ]
    rows += [(name, t[key]) for name, key in (("drafter folder", "drafter_folder"), ("training curve", "training_curve"),
                                              ("this table", "summary")) if t.get(key)]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
