"""dflash.decode: speculative decoding with a DFlash drafter against the target, and its greedy baseline: the
dynamic loop over transformers' cache (speculative.py), the static-cache, CUDA-graph decoder (static.py), and
`dflash eval --prompts` (prompt_eval.py). It imports no training code: the caller resolves a drafter folder."""
