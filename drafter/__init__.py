"""dflash.drafter: the DFlash drafter and what it eats: the model, its packed input layout, attention masks and
kernels, the target's frozen head, the drafter's folder format, and speculative decoding with it.

It imports neither storage/ nor train/, so eval, export, the demo and benchmarks use it without the training loop.
"""
