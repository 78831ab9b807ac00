"""dflash.targets: everything that runs the target model: loading it (load.py), the architecture adapter (which
decoder stack, which layer kinds, adapter.py), the attention and experts kernels checked against the model's eager
float32 forward (kernels.py), the truncated runner extract captures features with (runner.py), what its forward
costs in FLOPs (flops.py), the static-cache forward decoding replays (static_kv.py), the frozen embedding and
lm_head training borrows (head.py) and the choice of compute dtype (numerics.py).

It imports neither storage/ nor the stages (extract, train, generate, decode); nothing heavy at import time.
"""
