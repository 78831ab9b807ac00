"""dflash.decode: speculative decoding with a DFlash drafter against the target, and its greedy baseline: the
dynamic loop over transformers' cache (speculative.py) and the static-cache, CUDA-graph decoder (static.py)."""
